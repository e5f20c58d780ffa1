"""Measure what `accel_gradsync.estimator.core` predicts: for each model (a spec `estimate` understands)
and sync mode, one optimizer step of M micro-batches, after a warm-up step, under the launched
accelerate config; reports the real reduce-scatters/all-reduces counted, and the unsharded gradient bytes the
wrapper holds after each deferred micro-batch, read from the tensors FSDP keeps (each tensor
once) and from the handle's `stats()`."""

import json
import time

START = time.time()

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, write_result
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from transformers import AutoModelForCausalLM

import accel_gradsync
from accel_gradsync.estimator.inputs import load_model_config

args = parse_args(
    [
        (("--models",), {"required": True, "help": "JSON list of model specs"}),
        (("--modes",), {"default": "per_micro_batch,deferred"}),
        (("--reduce-dtypes",), {"default": "auto"}),
        (("--M",), {"type": int, "default": 3}),
        (("--seq",), {"type": int, "default": 8}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)


def held_tensor_bytes(model: torch.nn.Module) -> dict:
    """Bytes and dtypes of the unsharded gradients FSDP holds now, each tensor counted once, and
    the bytes of FSDP2's unsharded params whose storage is allocated (what a window keeps)."""
    grads, params = {}, {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    unsharded = getattr(p, "_unsharded_param", None)
                    if unsharded is not None and unsharded.untyped_storage().size() > 0:
                        params[id(unsharded)] = unsharded
                    grad = p.unsharded_accumulated_grad
                    grad = p._unsharded_param.grad if grad is None else grad
                    if grad is not None:
                        grads[id(grad)] = grad
        elif isinstance(module, FSDP1) and module._handle is not None and module._handle.flat_param.grad is not None:
            grad = module._handle.flat_param.grad
            grads[id(grad)] = grad
    return {
        "bytes": sum(g.numel() * g.element_size() for g in grads.values()),
        "dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in grads.values()}),
        "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
    }


results = []
setup_seconds = time.time() - START
# reduce_dtype must reach FSDP before prepare and stays on accelerate's plugin: "auto" first.
for reduce_dtype in args.reduce_dtypes.split(","):
    for spec in json.loads(args.models):
        model_config = load_model_config(spec)
        for mode in args.modes.split(","):
            began = time.time()
            set_seed(0)
            # "deferred+windowed": the estimate's row for deferral with keep_params_unsharded.
            window = mode == "deferred+windowed"
            config = accel_gradsync.GradSyncConfig(
                sync_mode="deferred" if window else mode, reduce_dtype=reduce_dtype, keep_params_unsharded=window
            )
            handle = accel_gradsync.attach(accelerator, config)
            model = AutoModelForCausalLM.from_config(model_config)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            model, optimizer = accelerator.prepare(model, optimizer)
            vocab = model_config.vocab_size
            # The estimate is per steady-state step: the first one may sync units FSDP2 cannot hold
            # before they have run once (see fsdp.FSDP2Adapter.holdable), so it is a warm-up.
            for k in range(2 * args.M):
                if k == args.M:
                    counter.take()
                    held = []
                ids = torch.randint(0, vocab, (1, args.seq), generator=torch.Generator().manual_seed(k))
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
                    if not accelerator.sync_gradients and k >= args.M:
                        with counter.paused():
                            held.append(held_tensor_bytes(model))
                    optimizer.step()
                    optimizer.zero_grad()
            counts = counter.take()
            stats = handle.stats()
            plan = handle.plan()
            results.append(
                {
                    "model": spec,
                    "mode": mode,
                    "reduce_dtype": reduce_dtype,
                    "counts": counts,
                    "held": held,
                    "stats": stats,
                    "seconds": round(time.time() - began, 2),
                    "units": [{"name": u.name, "numel": u.numel, "held_dtype": str(u.held_dtype)} for u in plan.held]
                    if plan is not None
                    else [],
                }
            )
            handle.detach()
            del model, optimizer
            accelerator.free_memory()

write_result(args.out, {"results": results, "setup_seconds": round(setup_seconds, 2)})
