"""The MLP benchmark's worker: one process group (2 ranks, or 4 for the 2x2 HSDP mesh) runs every
configuration given, for one model size and every M, and writes `rank<R>.json`. Each configuration
has an `Accelerator` of its own; each round runs one step of each in an order rotated per round
(`mlp.round_order`), so load from other processes slows all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

import accel_gradsync
from accel_gradsync.planning.costs import REDUCE_SCATTER_COST
from benchmarks import mlp
from benchmarks.measure import StepMeter, attach, pin_to_core, scalar_stats, versions, worker_args, write_rank
from benchmarks.records import RankRecord, RankResult, StepSample
from testbed.collectives import CollectiveCounter

LR = 1e-3
WARMUP = 1  # untimed steps after each prepare


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Residual MLP `Block`s (the FSDP unit, `fsdp_transformer_layer_cls_to_wrap: Block`) and a
    root as large as a block (an input projection and an output head, as a language model's root
    holds its embedding and head), so U = layers + 1. Returns {"loss": ...}, as a model in a Trainer does."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4 * dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 4 * dim)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return {"loss": F.mse_loss(self.head(x), y)}


class Bench:
    """What every configuration shares: the counter, the step meter, the model and the data."""

    def __init__(self, args: argparse.Namespace) -> None:
        accel_gradsync.enable_cpu_fsdp()  # no-op with a GPU/NPU: accelerate handles FSDP there
        self.counter = CollectiveCounter()
        self.accelerator = acc = Accelerator(gradient_accumulation_steps=1)
        self.device, self.world, self.rank = acc.device, acc.num_processes, acc.process_index
        self.meter = StepMeter(self.device.type)
        self.args, self.size, self.Ms = args, mlp.SIZES[args.size], [int(m) for m in args.Ms.split(",")]
        set_seed(0)
        self.template = Net(self.size["dim"], self.size["layers"])
        params = sum(p.numel() for p in self.template.parameters())
        # Enough global rows of 4 dim features in and out for the longest step; rank r reads what a
        # DistributedSampler without shuffling would give it.
        g = torch.Generator().manual_seed(1)
        rows = (self.world * self.size["rows"] * max(self.Ms), 4 * self.size["dim"])
        self.X, self.Y = torch.randn(*rows, generator=g), torch.randn(*rows, generator=g)
        self.facts = {
            "params": params,
            "units": self.size["layers"] + 1,
            "world_size": self.world,
            "full_defer_grad_bytes": params * 4,  # fp32 params, no mixed precision: fp32 grads
            "windowed_bytes": params * 4 * 2,  # and the unsharded fp32 params beside them
            "sharded_grad_bytes": params * 4 // self.world,
            **{k: v for k, v in self.size.items() if k != "steps"},
        }

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.size["rows"]
        idx = torch.arange(k * rows, (k + 1) * rows) * self.world + self.rank
        return self.X[idx].to(self.device), self.Y[idx].to(self.device)

    def sample(self, measured: dict, **extra: Any) -> StepSample:
        """The step just metered, with its collectives since the counter's last take and its peaks."""
        traffic = vars(self.counter.take_traffic())
        return StepSample(**measured, **traffic, device_peak_bytes=self.meter.device_peak, **extra)


@dataclass
class Prepared:
    name: str
    spec: dict[str, Any]  # its `mlp.CONFIGS` entry
    acc: Accelerator
    model: Any  # the prepared FSDP2 model
    optimizer: Any  # the prepared optimizer (`.optimizer`: the bare torch one)
    handle: Any = None  # the plugin's handle, for configurations that attach it


def micro_batch(run: Prepared, last: bool):
    """What a loop does around a micro-batch besides forward and backward, the sync choice: the raw
    loops' and windowed's flags by hand, else accelerate's `accumulate`."""
    loop, model = run.spec["loop"], run.model
    if loop.startswith("raw"):
        model.set_requires_gradient_sync(last)
    if loop.endswith("windowed"):
        model.set_reshard_after_backward(last)
    return contextlib.nullcontext() if loop.startswith("raw") else run.acc.accumulate(model)


def step(bench: Bench, run: Prepared, M: int) -> None:
    """One optimizer step of M micro-batches. "accumulate": the accelerate docs' loop, stepping on the
    micro-batch that syncs, as the Trainer does; "raw": verl's, FSDP2's own switch and the bare torch
    optimizer, the floor for a wrapper's overhead; "*_windowed": PyTorch issue 124319 by hand."""
    raw = run.spec["loop"].startswith("raw")
    for k in range(M):
        x, y = bench.batch(k)
        with micro_batch(run, k == M - 1):
            loss = run.model(x, y)["loss"]
            (loss / M).backward() if raw else run.acc.backward(loss)
            bench.meter.probe(run.model)
            if not raw and run.acc.sync_gradients:
                run.optimizer.step()
                run.optimizer.zero_grad()
    if raw:
        run.optimizer.optimizer.step()
        run.optimizer.optimizer.zero_grad(set_to_none=True)


def prepare(bench: Bench, name: str) -> Prepared:
    """The configuration's own Accelerator, model, optimizer and, with the plugin, its handle. The
    plan is made once, at attach, for the largest M (budget and auto levels depend on M)."""
    spec = mlp.CONFIGS[name]
    acc = Accelerator(gradient_accumulation_steps=max(bench.Ms))
    model = copy.deepcopy(bench.template).to(bench.device)  # HSDP: the launch's parallelism_config
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    if spec.get("reshard_after_forward") is False:  # what `fsdp_reshard_after_forward: false` gives
        model.set_reshard_after_forward(False)
    kwargs = spec["gradsync"](bench.facts) if callable(spec["gradsync"]) else spec["gradsync"]
    return Prepared(name, spec, acc, model, optimizer, attach(acc, kwargs))


def set_accumulation(run: Prepared, M: int) -> None:
    """accelerate keeps M and sync_each_batch in state every instance shares: set them per step."""
    run.acc.gradient_accumulation_steps, run.acc.step = M, 0
    run.acc.gradient_state.plugin_kwargs["sync_each_batch"] = bool(run.spec.get("sync_each_batch"))


def measure_step(bench: Bench, run: Prepared, M: int, rep: int = 0, round_index: int | None = None) -> StepSample:
    """One optimizer step of M micro-batches: time, collectives, held bytes and memory peaks."""
    set_accumulation(run, M)
    dist.barrier()  # every rank starts the step together; not a wrapped collective
    bench.counter.take()
    bench.meter.start()
    step(bench, run, M)
    measured = bench.meter.stop()
    handle_held = None if run.handle is None else run.handle.stats()["last_step/held_grad_bytes"]
    return bench.sample(measured, handle_held_grad_bytes=handle_held, rep=rep, round=round_index)


def measure_sync_control(run: Prepared, iterations: int = 100, repeats: int = 5) -> float:
    """Microseconds per micro-batch of `micro_batch` alone, a held and a syncing one: the whole of what
    a wrapper can add, apart from step noise (the minimum over repeats drops interrupted ones)."""
    set_accumulation(run, 2)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            for last in (False, True):  # a held micro-batch, then the one that syncs
                with micro_batch(run, last):
                    pass
        best = min(best, (time.perf_counter() - t0) / (2 * iterations) * 1e6)
    run.acc.step = 0
    return best


def main() -> None:
    args = worker_args(size="", configs="", Ms="1,2,4,8", reps=3, steps=2)
    core = pin_to_core() if args.pin_cores else None
    bench, names = Bench(args), args.configs.split(",")
    # What the budget planner assumes a reduce-scatter byte costs against an all-gather byte on
    # this backend: the report holds it against what this run's steps paid.
    bench.facts["planner_reduce_scatter_cost"] = REDUCE_SCATTER_COST.get(dist.get_backend(), 1.0)
    runs = {n: prepare(bench, n) for n in names}
    for run in runs.values():  # FSDP's lazy init and first allocations, untimed
        for _ in range(WARMUP):
            measure_step(bench, run, 1)
    sync_control = {name: measure_sync_control(run) for name, run in runs.items()}
    # `join` configurations: each timed step inside a join() of its own, entered and left with it
    # (the leave costs one more poll per step); the other configurations' steps stay outside it,
    # since join() refuses a step of an optimizer its accelerator did not prepare (a raw loop's).
    # The microbenchmark above stays outside it (it measures the sync choice; with nothing to
    # overlap, a poll is a bare round trip).
    samples: dict[tuple[str, int], list[StepSample]] = {}
    rounds = 0
    for rep in range(args.reps):
        for M in bench.Ms:
            t0 = time.time()
            for _ in range(args.steps):
                for name in mlp.round_order(list(runs), rounds):
                    run = runs[name]
                    with run.handle.join() if run.spec.get("join") else contextlib.nullcontext():
                        sample = measure_step(bench, run, M, rep, rounds)
                    samples.setdefault((name, M), []).append(sample)
                rounds += 1
            if bench.rank == 0:  # progress, streamed by run.py
                fastest = ", ".join(f"{n} {min(s.time_s for s in samples[(n, M)]) * 1e3:.0f}ms" for n in names)
                print(f"[bench] {args.size} rep {rep} M={M}: {fastest} ({time.time() - t0:.1f}s)", flush=True)
    stats = {name: scalar_stats(run.handle) for name, run in runs.items()}
    records = [
        RankRecord(config=n, M=M, steps=s, sync_control_us=sync_control[n], stats=stats[n])
        for (n, M), s in samples.items()
    ]
    launch = {"size": args.size, "facts": bench.facts, "pinned_core": core, "versions": versions()}
    write_rank(args.out, bench.rank, RankResult(**launch, device=bench.device.type, records=records))


if __name__ == "__main__":
    main()
