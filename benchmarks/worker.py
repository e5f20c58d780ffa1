"""One launched process group (2 ranks, or 4 for the 2x2 HSDP mesh): every configuration given,
for one model size, every M, all in this one process so start-up is paid once.

Configurations are interleaved: each repetition runs every configuration once (in an order
rotated per repetition), so a noisy neighbour on the machine slows all of them alike instead
of one. Each (configuration, M) segment runs warm-up steps (where held gradient bytes are
probed from the real tensors) and then timed steps with the collectives counted. Every rank
writes `rank<R>.json`; `run.py` merges them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launched as a script

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

import accel_gradsync  # noqa: E402
from benchmarks import registry  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    CollectiveMeter,
    device_peak_bytes,
    handle_held_bytes,
    held_grad_bytes,
    peak_rss_bytes,
    reset_device_peak,
    reset_peak_rss,
)
from benchmarks.model import Net, make_data  # noqa: E402

LR = 1e-3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--size", required=True, choices=list(registry.SIZES))
    p.add_argument("--configs", required=True, help="comma-separated names from registry.CONFIGS")
    p.add_argument("--Ms", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per segment")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed optimizer steps after each prepare (the Trainer: per M)")
    return p.parse_args()


class Bench:
    """What every configuration shares: the accelerator, the meter, the model and the data."""

    def __init__(self, args: argparse.Namespace) -> None:
        accel_gradsync.enable_cpu_fsdp()  # no-op with a GPU/NPU: accelerate handles FSDP there
        self.meter = CollectiveMeter()
        self.accelerator = Accelerator(gradient_accumulation_steps=1)
        self.device = self.accelerator.device
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.size = registry.SIZES[args.size]
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
            "sharded_grad_bytes": params * 4 // self.world,
            **self.size,
        }
        self.probing = False
        self.probes: list[int] = []

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.size["rows"]
        idx = torch.arange(k * rows, (k + 1) * rows) * self.world + self.rank
        return self.X[idx].to(self.device), self.Y[idx].to(self.device)

    def probe(self, model) -> None:
        """Called after every backward; records held gradient bytes during warm-up steps only."""
        if self.probing:
            self.probes.append(held_grad_bytes(model))

    def build_model(self):
        return copy.deepcopy(self.template).to(self.device)


# -- one optimizer step, per loop -----------------------------------------------------------
def step_accumulate(bench: Bench, run: dict, M: int) -> None:
    """What the accelerate docs show: `accumulate` around every micro-batch."""
    acc, model, optimizer = bench.accelerator, run["model"], run["optimizer"]
    for k in range(M):
        x, y = bench.batch(k)
        with acc.accumulate(model):
            acc.backward(model(x, y)["loss"])
            bench.probe(model)
            optimizer.step()
            optimizer.zero_grad()


def step_raw(bench: Bench, run: dict, M: int) -> None:
    """verl's approach: FSDP2's own switch, flipped by hand, and the bare torch optimizer.
    Nothing between the user and FSDP, so it is the lower bound for any wrapper's overhead."""
    model, optimizer = run["model"], run["optimizer"].optimizer
    for k in range(M):
        x, y = bench.batch(k)
        model.set_requires_gradient_sync(k == M - 1)
        (model(x, y)["loss"] / M).backward()
        bench.probe(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


LOOPS = {"accumulate": step_accumulate, "raw": step_raw}


# -- one configuration ----------------------------------------------------------------------
def check_available(name: str, facts: dict) -> str | None:
    """Why this accel_gradsync cannot run the configuration, or None when it can."""
    kwargs = registry.gradsync_kwargs(name, facts)
    if kwargs is None:
        return None
    try:
        config = accel_gradsync.GradSyncConfig(**kwargs)
    except (TypeError, ValueError) as e:
        return f"not available in this version: {e}"
    mode = getattr(config, "sync_mode", None) or config.mode
    if mode not in accel_gradsync.POLICIES:
        return f"not available in this version: no policy {mode!r}"
    return None


def prepare(bench: Bench, name: str) -> dict:
    spec = registry.CONFIGS[name]
    model = bench.build_model()  # HSDP: the launch's parallelism_config gives the 2x2 mesh
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = bench.accelerator.prepare(model, optimizer)
    kwargs = registry.gradsync_kwargs(name, bench.facts)
    handle = None
    if kwargs is not None:
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # the one-line decision, per prepare
            handle = accel_gradsync.attach(bench.accelerator, accel_gradsync.GradSyncConfig(**kwargs))
    return {"model": model, "optimizer": optimizer, "handle": handle, "spec": spec}


def release(bench: Bench, run: dict) -> None:
    if run["handle"] is not None:
        run["handle"].detach()
    run.clear()
    bench.accelerator.free_memory()
    gc.collect()


def measure_segment(bench: Bench, name: str, run: dict, M: int) -> dict:
    """Timed steps, with collectives counted and held gradient bytes probed after every
    backward (a walk over a few dozen FSDPParams: microseconds against a step of seconds)."""
    acc = bench.accelerator
    acc.gradient_accumulation_steps = M
    acc.step = 0
    acc.gradient_state.plugin_kwargs["sync_each_batch"] = bool(run["spec"].get("sync_each_batch"))
    step = LOOPS[run["spec"]["loop"]]
    rss_reset = reset_peak_rss()
    rss_before = psutil.Process().memory_info().rss
    reset_device_peak(bench.device.type)
    steps, bench.probes = [], []
    bench.probing = True
    for _ in range(bench.args.steps):
        dist.barrier()  # every rank starts the step together; not a wrapped collective
        bench.meter.take()
        t0 = time.perf_counter()
        step(bench, run, M)
        synchronize(bench.device)
        elapsed = time.perf_counter() - t0
        steps.append({"time_s": elapsed, **bench.meter.take()})
    bench.probing = False
    stats = run["handle"].stats() if run["handle"] is not None else {}
    return record(bench, name, M, steps, stats, rss_reset, rss_before)


def warm_up(bench: Bench, name: str, run: dict) -> None:
    """Untimed steps after prepare: FSDP's lazy init and the first allocations happen here, not
    in the first timed M."""
    steps, bench.args.steps = bench.args.steps, bench.args.warmup
    try:
        measure_segment(bench, name, run, 1)
    finally:
        bench.args.steps = steps


def record(bench: Bench, name: str, M: int, steps: list, stats: dict, rss_reset: bool, rss_before: int) -> dict:
    # The tensors' count is the same for every loop (plugin or not): sharded plus unsharded
    # gradients. The plugin's own measure, where this version has one, is kept beside it.
    held = {"bytes": max(bench.probes, default=0), "source": "tensors (FSDPParam grads, max after each backward)"}
    from_handle = handle_held_bytes(stats)
    if from_handle is not None:
        held["handle_key"], held["handle_bytes"] = from_handle
    return {
        "config": name,
        "M": M,
        "steps": steps,
        "held_grad": held,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_bytes": rss_before,
        "peak_rss_scope": "segment" if rss_reset else "process",
        "device_peak_bytes": device_peak_bytes(bench.device.type),
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }


def synchronize(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type in ("cuda", "npu") and backend is not None:
        backend.synchronize()


# -- the stock Trainer peer -----------------------------------------------------------------
def measure_trainer(bench: Bench, name: str, M: int) -> dict:
    """A stock `transformers.Trainer` on the same model and samples, timed per optimizer step
    by a callback (from `on_step_begin` to `on_step_end`)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    total = bench.args.warmup + bench.args.steps
    rows, world = bench.size["rows"], bench.world
    n = world * rows * M * total
    data = [{"x": bench.X[i % len(bench.X)], "y": bench.Y[i % len(bench.Y)]} for i in range(n)]
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            bench.probing = True
            dist.barrier()
            bench.meter.take()
            self.t0 = time.perf_counter()

        def on_substep_end(self, args, state, control, **kw):
            bench.probe(trainer.model_wrapped)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            bench.probe(trainer.model_wrapped)

        def on_step_end(self, args, state, control, **kw):
            synchronize(bench.device)
            elapsed = time.perf_counter() - self.t0
            counts = bench.meter.take()
            bench.probing = False
            if state.global_step > bench.args.warmup:
                steps.append({"time_s": elapsed, **counts})

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=rows, gradient_accumulation_steps=M, max_steps=total,
            learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=0.0,  # clipping adds an all-reduce the other loops do not have
            logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
            dataloader_drop_last=True, accelerator_config={"use_configured_state": True},
        )  # fmt: skip
        trainer = Trainer(model=copy.deepcopy(bench.template), args=args, train_dataset=data,
                          callbacks=[Timer()])  # fmt: skip
        rss_reset = reset_peak_rss()
        rss_before = psutil.Process().memory_info().rss
        reset_device_peak(bench.device.type)
        bench.probes = []
        trainer.train()
        wrapper = type(trainer.model_wrapped).__name__
    out = record(bench, name, M, steps, {"wrapper_class": wrapper}, rss_reset, rss_before)
    del trainer
    gc.collect()
    return out


# -- the run --------------------------------------------------------------------------------
def run_configuration(bench: Bench, name: str) -> list[dict]:
    t0 = time.time()
    if registry.CONFIGS[name]["loop"] == "trainer":
        out = [measure_trainer(bench, name, M) for M in bench.Ms]
    else:
        run = prepare(bench, name)
        try:
            warm_up(bench, name, run)
            out = [measure_segment(bench, name, run, M) for M in bench.Ms]
        finally:
            release(bench, run)
    if bench.rank == 0:  # progress, streamed by run.py
        times = ", ".join(f"M={r['M']} {min(s['time_s'] for s in r['steps']) * 1e3:.0f}ms" for r in out)
        print(f"[bench] {bench.args.size} {name}: {times} ({time.time() - t0:.1f}s)", flush=True)
    return out


def main() -> None:
    args = parse_args()
    bench = Bench(args)
    names = args.configs.split(",")
    unavailable = {n: r for n in names if (r := check_available(n, bench.facts)) is not None}
    names = [n for n in names if n not in unavailable]
    records = []
    if names:
        run_configuration(bench, names[0])  # process-wide first-use costs, discarded
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)] if names else []
        for name in order:
            for rec in run_configuration(bench, name):
                rec["rep"] = rep
                records.append(rec)
    result = {"size": args.size, "facts": bench.facts, "device": bench.device.type,
              "unavailable": unavailable, "records": records, "versions": versions()}  # fmt: skip
    Path(args.out, f"rank{bench.rank}.json").write_text(json.dumps(result, indent=1, default=str))


def versions() -> dict:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__, "accel_gradsync": accel_gradsync.__version__,
            "backend": dist.get_backend()}  # fmt: skip


if __name__ == "__main__":
    main()
