"""The MLP benchmark's worker: one launched process group (2 ranks, or 4 for the 2x2 HSDP mesh)
runs every configuration given, for one model size and every M, in this one process.

Each configuration is prepared up front on an `Accelerator` of its own (so the plugin attaches to
its own model only), and each round runs one optimizer step of every configuration in an order
rotated per round (`mlp.round_order`), so load from other processes slows all of them alike; the
two configurations of an overhead pair (`mlp.PAIRS`) run back to back. The stock Trainer runs its
own loop, so it is interleaved per M instead. Every step is timed, its collectives counted, its
held bytes probed from the real tensors and its peak RSS read; each rank writes `rank<R>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launched as a script

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch import nn  # noqa: E402

import accel_gradsync  # noqa: E402
from benchmarks import mlp  # noqa: E402
from benchmarks.collectives import CollectiveCounter  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    device_peak_bytes,
    held_grad_bytes,
    held_param_bytes,
    peak_rss_bytes,
    pin_to_core,
    start_memory,
    synchronize,
    versions,
)
from benchmarks.records import RankRecord, RankResult, StepSample  # noqa: E402

LR = 1e-3


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
    holds its embedding and head), so U = layers + 1. Inputs and targets have 4 dim features;
    returns {"loss": ...} so the same model runs under a stock `Trainer`."""

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


def make_data(rows: int, dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` global samples of 4 dim features in and out; every configuration reads the same ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4 * dim, generator=g), torch.randn(rows, 4 * dim, generator=g)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--size", required=True, choices=list(mlp.SIZES))
    p.add_argument("--configs", required=True, help="comma-separated names from mlp.CONFIGS")
    p.add_argument("--Ms", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per segment")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after each prepare (the Trainer: per M)")
    p.add_argument("--pin-cores", action="store_true", help="CPU: pin each rank to a core (`measure.pin_to_core`)")
    return p.parse_args()


class Bench:
    """What every configuration shares: the accelerator, the counter, the model and the data."""

    def __init__(self, args: argparse.Namespace) -> None:
        accel_gradsync.enable_cpu_fsdp()  # no-op with a GPU/NPU: accelerate handles FSDP there
        self.counter = CollectiveCounter()
        self.accelerator = Accelerator(gradient_accumulation_steps=1)
        self.device = self.accelerator.device
        self.world, self.rank = (self.accelerator.num_processes, self.accelerator.process_index)
        self.size = mlp.SIZES[args.size]
        self.Ms = [int(m) for m in args.Ms.split(",")]
        self.args = args
        set_seed(0)
        self.template = Net(self.size["dim"], self.size["layers"])
        params = sum(p.numel() for p in self.template.parameters())
        rows = self.size["rows"]
        # Enough global rows for the longest segment; rank r reads what a DistributedSampler
        # without shuffling would give it, so the Trainer peer sees the same samples.
        self.X, self.Y = make_data(self.world * rows * max(self.Ms), self.size["dim"])
        self.facts = {
            "params": params,
            "units": self.size["layers"] + 1,
            "world_size": self.world,
            "full_defer_grad_bytes": params * 4,  # fp32 params, no mixed precision: fp32 grads
            "full_window_bytes": params * 4 * 2,  # and the unsharded fp32 params beside them
            "sharded_grad_bytes": params * 4 // self.world,
            **{k: v for k, v in self.size.items() if k != "steps"},  # steps: a run setting, not a fact
        }
        self.probing = False
        self.probes: list[tuple[int, int]] = []

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.size["rows"]
        idx = torch.arange(k * rows, (k + 1) * rows) * self.world + self.rank
        return self.X[idx].to(self.device), self.Y[idx].to(self.device)

    def probe(self, model) -> None:
        """Called after every backward of a timed step: (held gradient, held unsharded param) bytes."""
        if self.probing:
            self.probes.append((held_grad_bytes(model), held_param_bytes(model)))

    def build_model(self):
        return copy.deepcopy(self.template).to(self.device)


@dataclass
class Prepared:
    """One configuration, prepared on its own `Accelerator` (accelerate shares the gradient state
    between instances, so M and sync_each_batch are set per step)."""

    name: str
    spec: dict[str, Any]  # its `mlp.CONFIGS` entry
    acc: Accelerator
    model: Any  # the prepared FSDP2 model
    optimizer: Any  # the prepared optimizer (`.optimizer`: the bare torch one)
    handle: Any = None  # the plugin's handle, for configurations that attach it


# -- one optimizer step, per loop -----------------------------------------------------------
def step_accumulate(bench: Bench, run: Prepared, M: int, window_by_hand: bool = False) -> None:
    """What the accelerate docs show, `accumulate` around every micro-batch, stepping the
    optimizer on the micro-batch that syncs, as the Trainer does (a `step()` on every micro-batch,
    left for accelerate to skip, costs import lookups in accelerate 1.15: the loop's cost, not the
    sync's). `window_by_hand` ("accumulate_window"): `fsdp_reshard_after_forward: false` (set at
    prepare) and `set_reshard_after_backward` on the last micro-batch only, inside this loop."""
    acc, model, optimizer = run.acc, run.model, run.optimizer
    for k in range(M):
        x, y = bench.batch(k)
        if window_by_hand:
            model.set_reshard_after_backward(k == M - 1)
        with acc.accumulate(model):
            acc.backward(model(x, y)["loss"])
            bench.probe(model)
            if acc.sync_gradients:
                optimizer.step()
                optimizer.zero_grad()


def step_raw(bench: Bench, run: Prepared, M: int, window: bool = False) -> None:
    """verl's approach: FSDP2's own switch flipped by hand and the bare torch optimizer, nothing
    between the user and FSDP: the floor for any wrapper's overhead. `window` ("raw_window",
    PyTorch issue 124319): params kept unsharded after forward (set at prepare) and resharded
    after backward only on the last micro-batch, so each unit all-gathers once per step."""
    model, optimizer = run.model, run.optimizer.optimizer
    for k in range(M):
        x, y = bench.batch(k)
        model.set_requires_gradient_sync(k == M - 1)
        if window:
            model.set_reshard_after_backward(k == M - 1)
        (model(x, y)["loss"] / M).backward()
        bench.probe(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


LOOPS = {
    "accumulate": step_accumulate,
    "accumulate_window": lambda bench, run, M: step_accumulate(bench, run, M, window_by_hand=True),
    "raw": step_raw,
    "raw_window": lambda bench, run, M: step_raw(bench, run, M, window=True),
}


# -- one configuration ----------------------------------------------------------------------
def prepare(bench: Bench, name: str) -> Prepared:
    """The configuration's own Accelerator (accelerate shares its state between instances),
    model, optimizer and, for plugin configurations, the attached handle."""
    spec = mlp.CONFIGS[name]
    # M is set per step (measure_step); the plan is made once, at attach, for the largest M,
    # since the levels budget and auto pick depend on M (nothing is held at M = 1).
    acc = Accelerator(gradient_accumulation_steps=max(bench.Ms))
    model = bench.build_model()  # HSDP: the launch's parallelism_config gives the 2x2 mesh
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = acc.prepare(model, optimizer)
    if spec.get("reshard_after_forward") is False:
        # What `fsdp_reshard_after_forward: false` in the accelerate config gives FSDP2's units.
        model.set_reshard_after_forward(False)
    kwargs = mlp.gradsync_kwargs(name, bench.facts)
    handle = None
    if kwargs is not None:
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # the one-line decision
            handle = accel_gradsync.attach(acc, accel_gradsync.GradSyncConfig(**kwargs))
    return Prepared(name, spec, acc, model, optimizer, handle)


def measure_step(bench: Bench, run: Prepared, M: int, rep: int = 0, round_index: int | None = None) -> StepSample:
    """One optimizer step of M micro-batches: time, collectives, held gradient bytes (probed after
    every backward: a walk over a few dozen FSDPParams, microseconds against a step of
    seconds) and peak RSS."""
    acc = run.acc
    # accelerate keeps M and sync_each_batch in state shared by all instances: set them per step.
    acc.gradient_accumulation_steps = M
    acc.step = 0
    acc.gradient_state.plugin_kwargs["sync_each_batch"] = bool(run.spec.get("sync_each_batch"))
    dist.barrier()  # every rank starts the step together; not a wrapped collective
    memory = start_memory(bench.device.type)
    bench.counter.take()
    bench.probes, bench.probing = [], True
    t0, cpu0 = time.perf_counter(), time.process_time()
    LOOPS[run.spec["loop"]](bench, run, M)
    synchronize(bench.device.type)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    bench.probing = False
    handle_held = None if run.handle is None else run.handle.stats()["last_step/held_grad_bytes"]
    return sample(bench, elapsed, cpu, memory, handle_held_grad_bytes=handle_held, rep=rep, round=round_index)


def sample(bench: Bench, elapsed: float, cpu: float, memory: dict, **extra: Any) -> StepSample:
    """The step just timed: its collectives since the counter's last take, the most bytes held
    after any of its backwards and its memory peaks."""
    traffic = bench.counter.take_traffic()
    peak = peak_rss_bytes()
    return StepSample(
        time_s=elapsed,
        cpu_s=cpu,
        **vars(traffic),
        held_grad_bytes=max((g for g, _ in bench.probes), default=0),
        held_param_bytes=max((p for _, p in bench.probes), default=0),
        peak_rss_bytes=peak,
        rss_growth_bytes=max(peak - memory["rss_before"], 0),
        peak_rss_scope="step" if memory["scoped"] else "process",
        device_peak_bytes=device_peak_bytes(bench.device.type),
        **extra,
    )


def measure_sync_control(bench: Bench, run: Prepared, iterations: int = 100, repeats: int = 5) -> float:
    """Microseconds per micro-batch spent choosing and applying the sync mode, without forward or
    backward: a non-final and a final `accumulate` (the raw loop: its two
    `set_requires_gradient_sync` calls). This is the whole of what a wrapper can add, measured
    apart from steps whose wall time on a shared machine varies by far more. The minimum over
    repeats drops the repeats the scheduler interrupted."""
    acc, model, loop = run.acc, run.model, run.spec["loop"]
    acc.gradient_accumulation_steps = 2
    acc.step = 0
    acc.gradient_state.plugin_kwargs["sync_each_batch"] = bool(run.spec.get("sync_each_batch"))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            for last in (False, True):  # a held micro-batch, then the one that syncs
                if loop.startswith("raw"):
                    model.set_requires_gradient_sync(last)
                if loop.endswith("window"):  # raw_window, accumulate_window: the window's flags by hand
                    model.set_reshard_after_backward(last)
                if not loop.startswith("raw"):
                    with acc.accumulate(model):
                        pass
        best = min(best, (time.perf_counter() - t0) / (2 * iterations) * 1e6)
    acc.step = 0
    return best


# -- the stock Trainer peer -----------------------------------------------------------------
def measure_trainer(bench: Bench, name: str, M: int, rep: int) -> tuple[list[StepSample], dict]:
    """A stock `transformers.Trainer` on the same model and samples, timed per optimizer step
    by a callback (from `on_step_begin` to `on_step_end`)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    total = bench.args.warmup + bench.args.steps
    rows, world = bench.size["rows"], bench.world
    n = world * rows * M * total
    data = [{"x": bench.X[i % len(bench.X)], "y": bench.Y[i % len(bench.Y)]} for i in range(n)]
    steps: list[StepSample] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            dist.barrier()
            self.memory = start_memory(bench.device.type)
            bench.counter.take()
            bench.probes, bench.probing = [], True
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_substep_end(self, args, state, control, **kw):
            bench.probe(self.trainer.model_wrapped)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            bench.probe(self.trainer.model_wrapped)

        def on_step_end(self, args, state, control, **kw):
            synchronize(bench.device.type)
            elapsed, cpu = (time.perf_counter() - self.t0, time.process_time() - self.cpu0)
            bench.probing = False
            step = sample(bench, elapsed, cpu, self.memory, rep=rep)
            if state.global_step > bench.args.warmup:
                steps.append(step)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=M,
            max_steps=total,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,  # clipping adds an all-reduce the other loops do not have
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            dataloader_drop_last=True,
            accelerator_config={"use_configured_state": True},
        )
        timer = Timer()
        trainer = Trainer(model=copy.deepcopy(bench.template), args=args, train_dataset=data, callbacks=[timer])
        timer.trainer = trainer  # the callbacks probe the model the Trainer wrapped
        trainer.train()
        wrapper = type(trainer.model_wrapped).__name__
    del trainer, timer
    gc.collect()
    return steps, {"wrapper_class": wrapper}


# -- the run --------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    core = pin_to_core() if args.pin_cores else None  # before torch starts its threads
    bench = Bench(args)
    names = args.configs.split(",")
    # What the budget planner assumes a reduce-scatter byte costs against an all-gather byte on
    # this backend: the report holds it against what the steps of this run paid.
    costs = accel_gradsync.planning.costs.REDUCE_SCATTER_COST
    bench.facts["planner_reduce_scatter_cost"] = costs.get(dist.get_backend(), 1.0)
    runs = {n: prepare(bench, n) for n in names if mlp.CONFIGS[n]["loop"] != "trainer"}
    trainers = [n for n in names if mlp.CONFIGS[n]["loop"] == "trainer"]
    for run in runs.values():  # FSDP's lazy init and first allocations, untimed
        for _ in range(args.warmup):
            measure_step(bench, run, 1)
    sync_control = {name: measure_sync_control(bench, run) for name, run in runs.items()}
    samples: dict[tuple[str, int], list[StepSample]] = {}
    stats: dict[str, dict] = {}
    rounds = 0
    for rep in range(args.reps):
        for M in bench.Ms:
            t0 = time.time()
            for _ in range(args.steps):
                for name in mlp.round_order(list(runs), rounds):
                    samples.setdefault((name, M), []).append(measure_step(bench, runs[name], M, rep, rounds))
                rounds += 1
            for name in trainers:
                steps, stats[name] = measure_trainer(bench, name, M, rep)
                samples.setdefault((name, M), []).extend(steps)
            if bench.rank == 0:  # progress, streamed by run.py
                fastest = ", ".join(f"{n} {min(s.time_s for s in samples[(n, M)]) * 1e3:.0f}ms" for n in names)
                print(f"[bench] {args.size} rep {rep} M={M}: {fastest} ({time.time() - t0:.1f}s)", flush=True)
    for name, run in runs.items():  # the stats at the end of the run
        stats[name] = run.handle.stats() if run.handle is not None else {}
    records = [
        RankRecord(
            config=name,
            M=M,
            steps=steps,
            stats={k: v for k, v in stats[name].items() if isinstance(v, (int, float, str))},
            sync_control_us=sync_control.get(name),
        )
        for (name, M), steps in samples.items()
    ]
    result = RankResult(size=args.size, facts=bench.facts, device=bench.device.type, pinned_core=core,
                        records=records, versions=versions())  # fmt: skip
    Path(args.out, f"rank{bench.rank}.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))


if __name__ == "__main__":
    main()
