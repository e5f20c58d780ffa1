"""Train TinyNet under the launched accelerate config (bf16 mixed precision) once per sync mode of
each case and compare the gradients the optimizer would step with: those of a holding mode
against per-micro-batch sync from the same weights and data. Reports each case's relative
difference, the dtype the plan holds gradients in, its decision line and the plugin's warnings.

A case is `{"name", "config": GradSyncConfig kwargs, "reference": GradSyncConfig kwargs}`;
`"after_prepare": true` attaches after `prepare` (too late for the reduce dtype). Every run takes
two windows of M micro-batches from the same weights (the first one's gradients are dropped
unstepped) and compares the second's: by then every FSDP2 unit has run once, so each can hold,
and `auto` has measured its first window (on a scripted device with room for everything) and
plans the second."""

import contextlib
import io
import json
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import TinyNet, make_data, parse_args, write_result
from torch.distributed.tensor import DTensor

import accel_gradsync
from accel_gradsync.planning.memory import ScriptedMemoryProbe

args = parse_args(
    [
        (("--cases",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 4}),
        (("--batch-size",), {"type": int, "default": 8}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
plugin = accelerator.state.fsdp_plugin
launched_policy = plugin.mixed_precision_policy  # attach writes a reduce dtype into it: each run starts afresh
N, b = accelerator.num_processes, args.batch_size


def train(config: dict, after_prepare: bool) -> dict:
    """One run: the final optimizer step's full gradients, the plan and what attach said."""
    plugin.mixed_precision_policy = launched_policy
    set_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(2 * args.M * N * b)
    probe = ScriptedMemoryProbe(2**40, [0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", accel_gradsync.GradSyncWarning)
        if after_prepare:
            model, optimizer = accelerator.prepare(model, optimizer)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # what attach says on the main process
            handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config), memory_probe=probe)
        if not after_prepare:
            model, optimizer = accelerator.prepare(model, optimizer)
        r = accelerator.process_index
        for k in range(2 * args.M):
            rows = slice((k * N + r) * b, (k * N + r + 1) * b)  # this rank's share of global micro-batch k
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x[rows]), y[rows]) / args.M)
                if accelerator.sync_gradients:
                    grads = local_grads(model)
                    optimizer.zero_grad()
    plan = handle.plan()
    held = [str(u.held_dtype).removeprefix("torch.") for u in plan.held]
    result = {
        "grads": grads,
        "held_dtypes": sorted(set(held)),
        "held_grad_bytes": plan.held_grad_bytes(),
        "peak_held_grad_bytes": handle.stats()["peak_held_grad_bytes"],
        "params": sum(u.numel for u in handle.units()),
        "compute_dtype": str(handle.units()[0].compute_dtype).removeprefix("torch."),
        "decision": handle.describe(),
        "attach_printed": printed.getvalue().splitlines(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, accel_gradsync.GradSyncWarning)],
    }
    handle.detach()
    accelerator.free_memory()
    return result


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every gradient (FSDP1's flat parameters cannot gather theirs)."""
    return {
        n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every parameter's whole gradient (the shards of all ranks), in fp64."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    sums = torch.zeros(2, dtype=torch.float64)
    for k in a:
        sums[0] += (a[k].double() - b[k].double()).pow(2).sum()
        sums[1] += b[k].double().pow(2).sum()
    dist.all_reduce(sums)
    return float((sums[0] / sums[1]).sqrt())


results = {}
for case in args.cases:
    held = train(case["config"], case.get("after_prepare", False))
    reference = train(case["reference"], case.get("after_prepare", False))
    results[case["name"]] = {
        "relative_difference": relative_difference(held.pop("grads"), reference.pop("grads")),
        **held,
        "reference_decision": reference["decision"],
    }
write_result(args.out, {"cases": results, "policy": repr(launched_policy)})
