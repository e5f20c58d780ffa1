"""`save_on_signal` in a plain `accumulate` loop: the loop asks `grad_sync.preempted()` after every
micro-batch (it answers at optimizer-step boundaries), saves with `accelerator.save_state` and
calls `grad_sync.exit_preempted()`, as docs/modes.md (Preemption) shows.

`--phase preempt`: trains TinyNet (AdamW, a decaying learning rate) for L micro-batches of M per
step uninterrupted and keeps this rank's parameter shards and optimizer state in
`--reference/rank<R>.pt`; then trains again from the same seed with
`GradSyncConfig(defer=True, save_on_signal="SIGTERM")`, and rank `--signal-rank` sends SIGTERM to
itself (to it alone, not to the launcher) before micro-batch `--signal-at`'s forward. Each rank
writes `rank<R>.json` (the optimizer step it was told at) before it saves to `--checkpoint` and
exits. `--phase after-loop`: the same loop with no signal inside it and no `detach()`; then rank
`--signal-rank` sends SIGTERM to itself and goes on with `--after-s` seconds of after-training work
(a final evaluation, save or upload that never asks again), printing when that work is done.
`--phase resume`: from another seed, loads `--checkpoint`, skips the micro-batches it
holds, trains to the end and writes which tensors differ from `--reference`, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import TinyNet, make_data, parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset

import accel_gradsync

B, LR, M, L = 2, 1e-2, 3, 12  # four optimizer steps of three micro-batches


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model, optimizer) -> dict:
    """This rank's parameter shards and optimizer state tensors, by name."""
    out = {f"param/{i}": local(p) for i, p in enumerate(model.parameters())}
    for index, entries in optimizer.optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            out[f"optim/{index}/{key}"] = local(value) if torch.is_tensor(value) else torch.tensor(value)
    return out


def prepare(accelerator: Accelerator, seed: int):
    X, Y = make_data(L * B * accelerator.num_processes)
    set_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator, config, seed: int, args, load_from: str | None = None, signal_at: int = -1) -> dict:
    model, optimizer, loader, scheduler = prepare(accelerator, seed)
    grad_sync = accel_gradsync.attach(accelerator, config)
    skip = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        skip = json.loads(Path(load_from, "micro_batches.json").read_text())["micro_batches"]
        loader = accelerator.skip_first_batches(loader, skip)
    rank = accelerator.process_index
    for k, (x, y) in enumerate(loader, start=skip):
        if k == signal_at and rank == args.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if grad_sync.preempted():  # False inside a window; a collective at each step's end
            step = (k + 1) // M
            Path(args.out, f"rank{rank}.json").write_text(json.dumps({"step": step, "micro_batch": k}))
            accelerator.save_state(args.checkpoint)
            if accelerator.is_main_process:
                Path(args.checkpoint, "micro_batches.json").write_text(json.dumps({"micro_batches": k + 1}))
            grad_sync.exit_preempted(args.checkpoint)
    out = snapshot(model, optimizer)
    if args.phase == "after-loop":
        if rank == args.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(int(args.after_s * 10)):  # the after-training work: the signal must not wait for it
                time.sleep(0.1)
            print(f"rank {rank}: after-training work done", flush=True)
        return out
    grad_sync.detach()
    accelerator.free_memory()
    return out


args = parse_args(
    [
        (("--phase",), {"choices": ["preempt", "after-loop", "resume"], "required": True}),
        (("--checkpoint",), {"required": True}),
        (("--reference",), {"required": True}),
        (("--signal-at",), {"type": int, "default": -1}),
        (("--signal-rank",), {"type": int, "default": 1}),
        (("--after-s",), {"type": float, "default": 0.0}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
accelerator = Accelerator(gradient_accumulation_steps=M)
mine = Path(args.reference, f"rank{accelerator.process_index}.pt")
preempting = accel_gradsync.GradSyncConfig(defer=True, save_on_signal="SIGTERM")
if args.phase == "preempt":
    torch.save(train(accelerator, accel_gradsync.GradSyncConfig(defer=True), 0, args), mine)
    train(accelerator, preempting, 0, args, signal_at=args.signal_at)
    write_result(args.out, {"finished": True})  # not reached when the signal came
elif args.phase == "after-loop":
    train(accelerator, preempting, 0, args)
    write_result(args.out, {"finished": True})
else:
    resumed = train(
        accelerator, preempting, 1, args, load_from=args.checkpoint
    )  # another seed: only the load can match
    reference = torch.load(mine)
    names = sorted(set(resumed) | set(reference))
    differs = [n for n in names if n not in resumed or n not in reference or not torch.equal(resumed[n], reference[n])]
    write_result(args.out, {"differs": differs, "tensors": len(names)})
