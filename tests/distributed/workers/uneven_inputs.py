"""Uneven inputs: each rank trains TinyNet on its own number of micro-batches (`--runs`: per run the
GradSyncConfig, each rank's count, and how the loop meets the unevenness). `join`: the loop inside
`grad_sync.join()`; `pad`: the reference, every rank runs the largest count, a rank past its own
repeating its last micro-batch with loss x 0 (what join() promises to equal); neither: uneven
counts met by `accelerator.wait_for_everyone()` or `save_state` (`check`). A run given
`watchdog_s` must hang: after that many seconds from its start each rank prints its stack and exits.

The loop, per run: AdamW and a LambdaLR scheduler (`scheduler`: prepared and stepped every
micro-batch, as accelerate expects, the default; `unprepared_step`: not prepared, stepped where an
optimizer step ends; `prepared_epoch` / `unprepared_epoch`: stepped once per epoch, after the
epoch's `join()` block; `none`), `clip_grad_norm_` at every optimizer step, `epochs` epochs (each
rank's count per epoch), inside `accumulate()` or (`accumulate: false`) accelerate's basic loop
(forward, backward, step, zero_grad), optionally logging each micro-batch's loss through `log`
(`gather`, `reduce`, `gather_for_metrics`), forwarding the model once more after each step's last
backward (`metric`: `no_grad` or `grad`, no backward after it), clipping after every micro-batch
too (`clip_every`), or saving at micro-batch `save_at` inside the block.
Reports per run the final parameters (compared in the worker, bit for bit, with the run named as
`reference`), the final learning rate, the logged values, the all-reduces counted from outside
over the loop, `stats()`, and the message of a ValueError raised on this rank."""

import faulthandler
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, full_params, make_data, parse_args, write_result

import accel_gradsync
from testbed.collectives import KIND

CLIP = 0.05  # below the gradients' norm: every step clips
EPOCH_ROWS = 64  # micro-batches of data per rank and epoch, more than any count

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
X, Y = make_data(4 * EPOCH_ROWS * N * B)


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch k (no two ranks, no two micro-batches alike)."""
    rows = slice((k * N + R) * B, (k * N + R + 1) * B)
    return X[rows], Y[rows]


class Loop:
    """One run's model, optimizer, scheduler and loop body."""

    def __init__(self, run: dict) -> None:
        self.run = run
        set_seed(0)
        model = TinyNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        self.kind = run.get("scheduler", "prepared_step")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        if self.kind.startswith("prepared"):
            self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            self.scheduler = None if self.kind == "none" else scheduler
        self.logged: list = []

    def micro_batch(self, x, y, scale: float = 1.0) -> None:
        if self.run.get("accumulate", True):
            with accelerator.accumulate(self.model):
                self.body(x, y, scale)
        else:
            self.body(x, y, scale)
        log = self.run.get("log")
        if log:
            loss = self.last_loss[None]  # x 0 past a padded rank's count, as a shadow's zeros
            self.logged.append(
                accelerator.reduce(loss, "sum").tolist()
                if log == "reduce"
                else getattr(accelerator, log)(loss).tolist()
            )

    def body(self, x, y, scale: float) -> None:
        loss = F.mse_loss(self.model(x), y)
        self.last_loss = loss.detach() * scale
        accelerator.backward(loss * scale)
        if accelerator.sync_gradients and self.run.get("metric"):  # a forward and no backward
            with torch.set_grad_enabled(self.run["metric"] == "grad"):
                self.model(x)
        if self.run.get("clip_every") and not accelerator.sync_gradients:  # too large a norm to scale
            accelerator.clip_grad_norm_(self.model.parameters(), 1e9)
        if accelerator.sync_gradients:  # the norm is a collective: a rank that left must clip too
            accelerator.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        if self.kind == "prepared_step" or (self.kind == "unprepared_step" and accelerator.sync_gradients):
            self.scheduler.step()
        self.optimizer.zero_grad()

    def end_epoch(self) -> None:
        if self.kind.endswith("_epoch"):
            self.scheduler.step()


def train(run: dict, handle, loop: Loop) -> None:
    for epoch in range(run.get("epochs", 1)):
        counts = run["counts"] if run.get("epochs", 1) == 1 else run["counts"][epoch]
        count, most, first = counts[R], max(counts), epoch * EPOCH_ROWS
        if run.get("join"):
            with handle.join():
                for k in range(count):
                    loop.micro_batch(*batch(first + k))
                    if run.get("evaluate_after") == k:
                        with torch.no_grad():  # an evaluation inside join(): refused on every rank
                            loop.model(batch(k)[0])
                    if run.get("save_at") == k:
                        accelerator.save_state(os.path.join(args.out, "inside"))
        elif run.get("pad"):
            for k in range(most):
                x, y = batch(first + min(k, count - 1))
                loop.micro_batch(x, y, scale=1.0 if k < count else 0.0)
        else:
            for k in range(count):
                loop.micro_batch(*batch(first + k))
            print(f"rank {R} ran {count} micro-batches and checks", flush=True)  # a hang's test reads it
            if run.get("check") == "save_state":
                accelerator.save_state(os.path.join(args.out, "checkpoint"))
            else:
                accelerator.wait_for_everyone()
        loop.end_epoch()


result: dict = {"runs": {}}
params: dict[str, dict] = {}
for run in args.runs:
    accelerator.gradient_accumulation_steps = run.get("M", args.M)
    loop = Loop(run)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    accelerator.step = 0  # accelerate's count of micro-batches: each run starts a window
    accelerator.gradient_state._set_sync_gradients(True)  # a run that ended mid-window left it False
    counter.take()
    if "watchdog_s" in run:  # a run that must hang: each rank prints where it waits, then exits 1
        faulthandler.dump_traceback_later(run["watchdog_s"], exit=True)
    error = None
    accelerator.even_batches = run.get("even_batches", True)
    try:
        train(run, handle, loop)
    except ValueError as e:
        error = str(e)
    accelerator.even_batches = True
    ran = counter.take()
    out = {
        "error": error,
        "all_reduces": sum(n for name, n in ran.items() if KIND[name] == "all_reduces"),
        "stats": {k: handle.stats()[k] for k in ("micro_batches", "optimizer_steps", "mode")},
        "lr": loop.optimizer.param_groups[0]["lr"],
        "logged": loop.logged,
        "saved_inside": os.path.exists(os.path.join(args.out, "inside")),
    }
    handle.detach()
    if error is None:
        params[run["name"]] = full_params(loop.model)
        if "reference" in run:
            mine, ref = params[run["name"]], params[run["reference"]]
            out["equal"] = all(torch.equal(mine[n], ref[n]) for n in ref)
            out["max_diff"] = max((mine[n] - ref[n]).abs().max().item() for n in ref)
            out["reference_lr"] = result["runs"][run["reference"]]["lr"]
    result["runs"][run["name"]] = out
    accelerator.free_memory()
    del loop

write_result(args.out, result)
