"""The uneven-steps benchmark's worker (`uneven_steps.py` launches it on 2 ranks): a token model
trained deferred with keep_params_unsharded, each round one optimizer step of every strategy on the same
rollouts, in an order rotated per round; writes `rank<R>.json` (per step: time, CPU time, counts
and tokens on this rank)."""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

import accel_gradsync
from benchmarks.measure import attach, pin_to_core, versions, worker_args, write_rank
from benchmarks.mlp_worker import Block
from benchmarks.uneven_steps import FULL, STRATEGIES

Batch = list[list[torch.Tensor]]  # a micro-batch: its sequences' token ids


def rollouts(args: argparse.Namespace, step: int, rank: int) -> list[torch.Tensor]:
    """This rank's `seqs` completions of step `step`: lognormal lengths (median, sigma), cut to 16..max_len."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    z = torch.randn(args.seqs, generator=g)
    lengths = (math.log(args.median) + args.sigma * z).exp().round().clamp(16, args.max_len).long()
    return [torch.randint(1, args.vocab, (int(n),), generator=g) for n in lengths]


def pack(seqs: list[torch.Tensor], budget: int) -> Batch:
    """First-fit decreasing into micro-batches of at most `budget` tokens."""
    bins: Batch = []
    for s in sorted(seqs, key=len, reverse=True):
        fit = next((b for b in bins if sum(map(len, b)) + len(s) <= budget), None)
        bins.append([s]) if fit is None else fit.append(s)
    return bins


def resplit(seqs: list[torch.Tensor], count: int) -> Batch:
    """`count` micro-batches balanced by tokens (longest first onto the lightest), as verl's
    `rearrange_micro_batches` re-partitions a rank's sequences into the DP group's largest count."""
    bins: Batch = [[] for _ in range(count)]
    for s in sorted(seqs, key=len, reverse=True):
        min(bins, key=lambda b: sum(map(len, b))).append(s)
    return bins


def plan(strategy: str, seqs: list[torch.Tensor], args: argparse.Namespace) -> tuple[Batch, int]:
    """This rank's micro-batches under `strategy` and how many of them carry loss (the rest x 0)."""
    if strategy == "fixed":  # `fixed` sequences each, padded to the longest at the forward
        batches = [seqs[i : i + args.fixed] for i in range(0, len(seqs), args.fixed)]
        return batches, len(batches)
    mine = pack(seqs, args.budget)
    if strategy == "token_budget":
        return mine, len(mine)
    largest = torch.tensor([len(mine)])
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # verl: the count's all_reduce(MAX) over the DP group
    if strategy == "pad_resplit":
        return resplit(seqs, int(largest.item())), int(largest.item())
    return mine + [mine[-1]] * (int(largest.item()) - len(mine)), len(mine)  # pad_dummy: the last x 0


def tensors(mb: list[torch.Tensor], padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of one micro-batch, concatenated, or each sequence padded to the longest (pad
    id 0, label -100); labels are the next token within each sequence."""
    pairs = [(s, max(map(len, mb)) - len(s) if padded else 0) for s in mb]
    ids = [F.pad(s, (0, p)) for s, p in pairs]
    labels = [F.pad(torch.cat([s[1:], torch.tensor([-100])]), (0, p), value=-100) for s, p in pairs]
    return torch.cat(ids), torch.cat(labels)


def run_step(acc, model, optimizer, handle, batches: Batch, carry: int, padded: bool, tokens: int) -> int:
    """One optimizer step in `grad_sync.step`, the batches past `carry` x 0, the loss a mean per
    token over every rank's step (docs/modes.md; `tokens`: this rank's); -> the tokens run."""
    processed = 0
    with handle.step(len(batches), tokens=tokens) as step:
        for k, mb in enumerate(batches):
            ids, labels = tensors(mb, padded)
            processed += len(ids)
            with acc.accumulate(model):
                loss = F.cross_entropy(model(ids), labels, ignore_index=-100, reduction="sum")
                scale = acc.num_processes * acc.gradient_accumulation_steps / step.tokens
                acc.backward(loss * (scale if k < carry else 0.0))
                optimizer.step()
                optimizer.zero_grad()
    return processed


def main() -> None:
    args = worker_args(**FULL, seed=0)
    core = pin_to_core() if args.pin_cores else None
    accel_gradsync.enable_cpu_fsdp()
    acc = Accelerator()
    set_seed(0)
    # A token model over a [tokens] input, the MLP benchmark's Blocks its FSDP units: every token
    # costs the same and none sees another, so packing sequences end to end is exact.
    net = nn.Sequential(nn.Embedding(args.vocab, args.dim), *(Block(args.dim) for _ in range(args.layers)))
    net.append(nn.Linear(args.dim, args.vocab))
    params = sum(p.numel() for p in net.parameters())
    model, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    handle = attach(acc, {"defer": True, "keep_params_unsharded": True})
    steps = []
    for r in range(-1, args.rounds):  # round -1: untimed warm-up (FSDP's lazy init)
        seqs = rollouts(args, r, acc.process_index)
        real = sum(map(len, seqs))
        for name in STRATEGIES[r % 4 :] + STRATEGIES[: r % 4]:
            dist.barrier()  # the step's time includes its packing and padding's count agreement
            t0, c0 = time.perf_counter(), time.process_time()
            batches, carry = plan(name, seqs, args)
            processed = run_step(acc, model, optimizer, handle, batches, carry, name == "fixed", real)
            row = {"strategy": name, "round": r, "time_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
            # padding: pad tokens (fixed) and the dummy micro-batches' tokens (pad_dummy)
            row.update(real_tokens=real, processed_tokens=processed, padding_tokens=processed - real)
            if r >= 0:
                steps.append({**row, "micro_batches": len(batches), "dummy_micro_batches": len(batches) - carry})
    kept = ("units", "units_windowed", "replayed_micro_batches", "evened_micro_batches")
    stats = {k: handle.stats()[k] for k in kept}
    out = {"pinned_core": core, "params": params, "steps": steps, "stats": stats, "versions": versions()}
    write_rank(args.out, acc.process_index, out)


if __name__ == "__main__":
    main()
