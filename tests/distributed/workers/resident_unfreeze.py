"""A model prepared with every parameter frozen, unfrozen piece by piece at optimizer-step
boundaries without `reshard()` first, as a user of stock accelerate would: `blocks.1` before step
1, `head` (the root's) before step 3, `blocks.1` frozen again before step 5. `--runs`: per run a
name and the GradSyncConfig (null: stock accelerate, no attach). Reports per run the reduce-scatters
of each optimizer step counted from outside, the final parameters' largest difference from the run
named `reference`, `stats()` and the lines printed."""

import contextlib
import io
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, make_data, parse_args, write_result
from torch.distributed.fsdp import FSDPModule

import accel_gradsync

STEPS = 6
CHANGES = {1: ("blocks.1", True), 3: ("head", True), 5: ("blocks.1", False)}  # before that step

args = parse_args([(("--runs",), {"type": json.loads, "required": True}), (("--M",), {"type": int, "default": 2})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
X, Y = make_data(STEPS * args.M * 2, seed=accelerator.process_index)


def full_params(model) -> dict:
    for module in model.modules():  # whatever a run kept unsharded, so full_tensor() reads shards
        if isinstance(module, FSDPModule):
            module.reshard()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


result: dict = {}
params: dict = {}
for run in args.runs:
    set_seed(0)
    model = TinyNet()
    model.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    printed = io.StringIO()
    handle = None
    with contextlib.redirect_stdout(printed):
        if run["config"] is not None:
            handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
        accelerator.step = 0
        counter.take()
        per_step = []
        for step in range(STEPS):
            if step in CHANGES:
                name, flag = CHANGES[step]
                model.get_submodule(name).requires_grad_(flag)  # no reshard() first
            for m in range(args.M):
                k = (step * args.M + m) * 2
                # What a user writes for a model that may have nothing to train yet: no graph, no step.
                trains = any(p.requires_grad for p in model.parameters())
                with accelerator.accumulate(model), torch.set_grad_enabled(trains):
                    loss = ((model(X[k : k + 2]) - Y[k : k + 2]) ** 2).mean()
                    if trains:
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
            ran = counter.take()
            per_step.append(sum(n for name, n in ran.items() if name.startswith("reduce_scatter")))
    out = {
        "reduce_scatters": per_step,
        "printed": [line for line in printed.getvalue().splitlines() if line.startswith("grad sync")],
    }
    if handle is not None:
        stats = handle.stats()
        out["stats"] = {k: stats[k] for k in ("optimizer_steps", "micro_batches", "reduce_scatters_issued")}
        handle.detach()
    params[run["name"]] = full_params(model)
    if "reference" in run:
        ref = params[run["reference"]]
        out["max_diff"] = max((params[run["name"]][n] - ref[n]).abs().max().item() for n in ref)
    result[run["name"]] = out
    accelerator.free_memory()
    del model, optimizer

write_result(args.out, result)
