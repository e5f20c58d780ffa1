"""One micro-batch per optimizer step (gradient_accumulation_steps=1) on the recipe's default
model: per sync mode, the all-gathers and reduce-scatters of each optimizer step counted from
outside, the unsharded parameter bytes FSDP2 holds between a step's forward and its backward,
the handle's `stats()` and the decision line it prints."""

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, write_result
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

import accel_gradsync
from accel_gradsync.estimator.inputs import load_model_config

args = parse_args([(("--steps",), {"type": int, "default": 3}), (("--seq",), {"type": int, "default": 8})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=1)
MODES = {  # the estimate's row name: the settings a run gives for it
    "per_micro_batch": {"sync_mode": "per_micro_batch"},
    "deferred+windowed": {"sync_mode": "deferred", "keep_params_unsharded": True},
}


def unsharded_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FSDP2 parameters that are unsharded right now, read from FSDP's own state
    (each parameter once: the modules sharded in one call share one state)."""
    unsharded = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p.sharded_state.name == "UNSHARDED":
                        unsharded[id(p)] = p.unsharded_param.numel() * p.unsharded_param.element_size()
    return sum(unsharded.values())


results = []
model_config = load_model_config("recipe-default")
for mode, settings in MODES.items():
    set_seed(0)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**settings))
    model = AutoModelForCausalLM.from_config(model_config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter.take()
    steps = []
    for k in range(args.steps):
        ids = torch.randint(0, model_config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(k))
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            with counter.paused():
                kept = unsharded_param_bytes(model)  # between this step's forward and its backward
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        steps.append({"counts": counter.take(), "kept_param_bytes": kept, "after_step": unsharded_param_bytes(model)})
    results.append({"mode": mode, "steps": steps, "stats": handle.stats(), "decision": handle.describe()})
    handle.detach()
    del model, optimizer
    accelerator.free_memory()

write_result(args.out, {"results": results})
