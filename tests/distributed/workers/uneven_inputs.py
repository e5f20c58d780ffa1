"""Uneven inputs: each rank trains TinyNet on its own number of micro-batches (`--runs`: per run the
GradSyncConfig, each rank's count, and how the loop meets the unevenness). `join`: the loop inside
`grad_sync.join()`; `pad`: the reference, every rank runs the largest count, a rank past its own
repeating its last micro-batch with loss x 0 (what join() promises to equal); neither: uneven
counts met by `accelerator.wait_for_everyone()` or `save_state` (`check`). AdamW and a LambdaLR
scheduler, both prepared, and `clip_grad_norm_` at every optimizer step. Reports per run the final
parameters (compared in the worker, bit for bit, with the run named as `reference`), the
all-reduces counted from outside over the loop, `stats()`, and the message of a ValueError raised
on this rank."""

import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, make_data, parse_args, write_result

import accel_gradsync
from benchmarks.collectives import KIND

CLIP = 0.05  # below the gradients' norm: every step clips

args = parse_args(
    [
        (("--runs",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 4}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
N, R, B = accelerator.num_processes, accelerator.process_index, 2
X, Y = make_data(16 * N * B)


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch k (no two ranks, no two micro-batches alike)."""
    rows = slice((k * N + R) * B, (k * N + R + 1) * B)
    return X[rows], Y[rows]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def micro_batch(model, optimizer, scheduler, x, y, scale: float = 1.0) -> None:
    with accelerator.accumulate(model):
        accelerator.backward(F.mse_loss(model(x), y) * scale)
        if accelerator.sync_gradients:  # the norm is a collective: a rank that left must clip too
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def train(run: dict, handle, model, optimizer, scheduler) -> None:
    count, most = run["counts"][R], max(run["counts"])
    if run.get("join"):
        with handle.join():
            for k in range(count):
                micro_batch(model, optimizer, scheduler, *batch(k))
                if run.get("evaluate_after") == k:
                    with torch.no_grad():  # an evaluation inside join(): refused on every rank
                        model(batch(k)[0])
    elif run.get("pad"):
        for k in range(most):
            micro_batch(model, optimizer, scheduler, *batch(min(k, count - 1)), scale=1.0 if k < count else 0.0)
    else:
        for k in range(count):
            micro_batch(model, optimizer, scheduler, *batch(k))
        if run.get("check") == "save_state":
            accelerator.save_state(os.path.join(args.out, "checkpoint"))
        else:
            accelerator.wait_for_everyone()


result: dict = {"runs": {}}
params: dict[str, dict] = {}
for run in args.runs:
    set_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    accelerator.step = 0  # accelerate's count of micro-batches: each run starts a window
    counter.take()
    error = None
    accelerator.even_batches = run.get("even_batches", True)
    try:
        train(run, handle, model, optimizer, scheduler)
    except ValueError as e:
        error = str(e)
    accelerator.even_batches = True
    ran = counter.take()
    out = {
        "error": error,
        "all_reduces": sum(n for name, n in ran.items() if KIND[name] == "all_reduces"),
        "stats": {k: handle.stats()[k] for k in ("micro_batches", "optimizer_steps", "mode")},
    }
    handle.detach()
    if error is None:
        params[run["name"]] = full_params(model)
        if "reference" in run:
            mine, ref = params[run["name"]], params[run["reference"]]
            out["equal"] = all(torch.equal(mine[n], ref[n]) for n in ref)
            out["max_diff"] = max((mine[n] - ref[n]).abs().max().item() for n in ref)
    result["runs"][run["name"]] = out
    accelerator.free_memory()
    del model, optimizer, scheduler

write_result(args.out, result)
