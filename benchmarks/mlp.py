"""The MLP benchmark: every sync mode of the plugin against the loops a user would otherwise write
(stock accelerate, hand-written FSDP2 loops) on residual MLPs of several sizes. This module holds
the configurations, presets, launches and the merge of the ranks' records; `mlp_worker.py`
measures, `mlp_report.py` reports.

A configuration (`CONFIGS`): `loop`, the training loop (`mlp_worker.step`); `gradsync`, the
`GradSyncConfig` arguments (a function of the model's facts, or None: no plugin); `join` (its steps
inside one `grad_sync.join()`); `sync_each_batch` (accelerate's flag); `reshard_after_forward:
False`; `mesh: "2x2"` (4 ranks as HSDP, else 2 of plain FSDP2); `group` and `label` for the report.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.records import ConfigResult, RankResult, Run, launch_fields, memory_max

WORKER = Path(__file__).with_name("mlp_worker.py")
KINDS = ("reduce_scatters", "all_reduces", "all_gathers")


def budget(fraction: float) -> Callable[[dict], dict]:
    """A budget of `fraction` x the bytes `windowed` holds on one rank (unsharded grads and params)."""
    return lambda facts: {"sync_mode": "budget", "memory_budget": f"{int(fraction * facts['windowed_bytes'])}B"}


def config(group: str, label: str, gradsync: Any = None, loop: str = "accumulate", **extra: Any) -> dict[str, Any]:
    return {"loop": loop, "gradsync": gradsync, "group": group, "label": label, **extra}


NO_RESHARD = {"reshard_after_forward": False}
CONFIGS: dict[str, dict[str, Any]] = {
    # The two modes of the plugin, through accelerate's own `accumulate`.
    "per_micro_batch": config("plugin", "accel_gradsync per-micro-batch", {"defer": False}),
    "deferred": config("plugin", "accel_gradsync deferred", {"defer": True}),
    # The same deferred loop inside `grad_sync.join()` (uneven inputs), on even inputs: what its
    # poll (one all-reduce per micro-batch) costs. Each timed step inside a join() of its own (its
    # leave untimed): one join() around every configuration's steps would see their optimizers too.
    "deferred_join": config(
        "plugin", "accel_gradsync deferred inside grad_sync.join(), even inputs", {"defer": True}, join=True
    ),
    "windowed": config(
        "plugin",
        "accel_gradsync deferred + keep_params_unsharded (params unsharded through the window)",
        {"defer": True, "keep_params_unsharded": True},
    ),
    # Memory-aware modes: each defers only what fits.
    **{
        f"budget_{p}": config("memory-aware", f"budget = {p}% of windowed's bytes", budget(p / 100))
        for p in (25, 50, 75)
    },
    "auto": config("memory-aware", "auto (from free memory)", {"sync_mode": "auto"}),
    # The peers a user would otherwise pick.
    "stock_accumulate": config("peer", "stock accelerate accumulate (no plugin)"),
    "stock_sync_each_batch": config("peer", "stock accelerate, sync_each_batch=True", sync_each_batch=True),
    "raw_fsdp2": config("peer", "hand-written set_requires_gradient_sync loop (verl)", loop="raw"),
    "raw_windowed": config(
        "peer", "hand-written windowed loop (PyTorch issue 124319)", loop="raw_windowed", **NO_RESHARD
    ),
    "stock_windowed_by_hand": config(
        "peer",
        "stock accelerate accumulate, windowed flags by hand (PyTorch issue 124319)",
        loop="accumulate_windowed",
        **NO_RESHARD,
    ),
    "stock_no_reshard": config("peer", "stock accelerate accumulate, fsdp_reshard_after_forward: false", **NO_RESHARD),
    # HSDP on a 2x2 (replicate x shard) mesh, 4 ranks.
    "hsdp_per_micro_batch": config("hsdp", "HSDP 2x2 per-micro-batch", {"defer": False}, mesh="2x2"),
    "hsdp_deferred": config("hsdp", "HSDP 2x2 deferred", {"defer": True}, mesh="2x2"),
    "hsdp_defer_all_reduce": config(
        "hsdp", "HSDP 2x2 all-reduce deferral", {"sync_mode": "defer_all_reduce"}, mesh="2x2"
    ),
}

# The overhead pairs: configurations that issue the same collectives on the same bytes, so
# their step times differ only by what the wrapper costs. The worker runs each pair back to
# back in every round and the report compares them round by round.
PAIRS: tuple[tuple[str, str], ...] = (
    ("deferred", "raw_fsdp2"),
    ("deferred", "deferred_join"),
    ("per_micro_batch", "stock_sync_each_batch"),
    ("windowed", "raw_windowed"),
    # The same windowed flags by hand, in accelerate's own loop: what the plugin adds to that loop,
    # apart from what the loop itself costs against `raw_windowed`.
    ("windowed", "stock_windowed_by_hand"),
)

# Model sizes: `layers` residual MLP blocks of width `dim` and a root of the same size (8 dim^2 +
# 5 dim parameters each; mlp_worker.Net). `rows` per micro-batch is small for "large": little
# compute per parameter, so the reduce-scatters dominate (the communication-bound case). `steps`:
# timed rounds per M in the full run; the small model's many cheap rounds are what resolves a
# wrapper's per-micro-batch cost, the largest share of the shortest step.
SIZES: dict[str, dict[str, int]] = {
    "small": {"dim": 128, "layers": 4, "rows": 64, "steps": 36},
    "medium": {"dim": 384, "layers": 4, "rows": 8, "steps": 3},
    "large": {"dim": 720, "layers": 4, "rows": 8, "steps": 3},
}

# HSDP runs 4 processes on the machine: one (communication-bound) size shows the trade-off.
HSDP_SIZE = "medium"

CORNERS = ["per_micro_batch", "deferred", "windowed"]  # the memory / time frontier's corners
HSDP = [name for name, spec in CONFIGS.items() if spec["group"] == "hsdp"]
QUICK = {
    "sizes": ["small"],
    "Ms": [1, 2, 4],
    "reps": 1,
    "steps": 2,
    "configs": [*CORNERS, "budget_50", "stock_accumulate", "stock_sync_each_batch", "raw_fsdp2", "raw_windowed"],
}
# steps None: each size's own `steps` (a full run must fit 10 minutes on 2 cores).
FULL = {"sizes": ["small", "large"], "Ms": [1, 2, 4, 8], "configs": list(CONFIGS), "reps": 1, "steps": None}


def ranks(name: str) -> int:
    return 4 if CONFIGS[name].get("mesh") == "2x2" else 2


# The simulated cluster (`--cluster 2x1`), run once per link bandwidth: every sync mode and peer
# across 2 hosts, and the HSDP mesh as 2 hosts x 2 ranks. The medium model and M = 1, 4, 8 keep a
# run of two links within the full run's time target on 2 cores.
CLUSTER = {
    "sizes": ["medium"],
    "Ms": [1, 4, 8],
    "reps": 1,
    "steps": 2,
    "configs": [*CORNERS, "budget_50", "auto", "stock_accumulate", "raw_fsdp2", "raw_windowed", *HSDP],
}
CLUSTER_QUICK = {
    "sizes": ["small"],
    "Ms": [1, 4],
    "reps": 1,
    "steps": 1,
    "hsdp_size": "small",
    "configs": [*CORNERS, "hsdp_per_micro_batch", "hsdp_defer_all_reduce"],
}


def round_order(names: list[str], k: int) -> list[str]:
    """Round k's order: the overhead pairs among `names` as adjacent blocks (a configuration in two
    pairs between its partners; as listed on even rounds, reversed on odd ones, so no configuration
    always runs first), every other configuration a block of its own, the blocks rotated by k."""
    blocks: list[list[str]] = []
    for a, b in [(a, b) for a, b in PAIRS if a in names and b in names]:
        block = next((c for c in blocks if a in (c[0], c[-1])), None)
        if block is None:
            blocks.append([a, b])
        else:
            block.insert(0, b) if block[0] == a else block.append(b)
    blocks = [block if k % 2 == 0 else block[::-1] for block in blocks]
    blocks += [[name] for name in names if all(name not in block for block in blocks)]
    k %= max(len(blocks), 1)
    return [name for block in blocks[k:] + blocks[:k] for name in block]


def plan(args: argparse.Namespace) -> dict:
    """What to run: the quick, full or cluster preset, with the flags' overrides."""
    presets = (CLUSTER_QUICK, CLUSTER) if args.cluster else (QUICK, FULL)
    base = dict(presets[0] if args.quick else presets[1])
    for key in ("sizes", "Ms", "configs"):
        if getattr(args, key):
            base[key] = getattr(args, key).split(",")
    for key in ("reps", "steps"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    base["Ms"] = [int(m) for m in base["Ms"]]
    base["hsdp_size"] = args.hsdp_size or base.get("hsdp_size", HSDP_SIZE)
    base.update(quick=args.quick, no_pin=args.no_pin)
    unknown = [c for c in base["configs"] if c not in CONFIGS] + [s for s in base["sizes"] if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown configuration or size: {', '.join(unknown)}")
    return base


def launches(p: dict) -> list[tuple[str, int, list[str]]]:
    """(size, ranks, configurations) per launch: one 2-rank process group per size, and one
    4-rank group for HSDP on `hsdp_size` (4 processes on the machine: one size shows the trade-off)."""
    two = [c for c in p["configs"] if ranks(c) == 2]
    four = [c for c in p["configs"] if ranks(c) == 4]
    out = [(size, 2, two) for size in p["sizes"] if two]
    if four:
        out.append((p["hsdp_size"], 4, four))
    return out


def worker_args(p: dict, size: str, names: list[str], device: str) -> list[str]:
    args = ["--size", size, "--configs", ",".join(names), "--Ms", ",".join(map(str, p["Ms"]))]
    args += ["--reps", str(p["reps"]), "--steps", str(p["steps"] or SIZES[size]["steps"])]
    return args + (["--pin-cores"] if device == "cpu" and not p.get("no_pin") else [])


def merge(ranks_json: list[dict]) -> Run:
    """One row per (configuration, M) from every rank and repetition: a step lasts as long as its
    slowest rank; counts and bytes are rank 0's (every rank issues the same), memory the max."""
    ranks_ = [RankResult.from_dict(r) for r in ranks_json]
    first, rows = ranks_[0], []
    for j, rec in enumerate(first.records):
        per_rank = [rank.records[j] for rank in ranks_]
        assert all((r.config, r.M) == (rec.config, rec.M) for r in per_rank), "ranks disagree on the records"
        steps = list(zip(*(r.steps for r in per_rank), strict=True))  # each timed step, on every rank
        times, cpus = ([max(getattr(s, k) for s in step) for step in steps] for k in ("time_s", "cpu_s"))
        every = [s for r in per_rank for s in r.steps]
        per_step = {
            f"{k}_per_step": statistics.median(getattr(s, k) for s in rec.steps) for k in (*KINDS, "bytes_sent")
        }
        rows.append(
            ConfigResult(
                config=rec.config,
                M=rec.M,
                step_time_s=statistics.median(times),
                step_times_s=times,
                step_rounds=[s.round for s in rec.steps],
                step_cpu_s=statistics.median(cpus),
                step_cpus_s=cpus,
                **per_step,
                counts_seen_per_step={kind: sorted({getattr(s, kind) for s in rec.steps}) for kind in KINDS},
                **memory_max(every, [s.handle_held_grad_bytes for s in every]),
                device_peak_bytes=max((s.device_peak_bytes or 0) for s in every) or None,
                stats=rec.stats,
                sync_control_us=max((r.sync_control_us or 0) for r in per_rank) or None,
            )
        )
    return Run(**launch_fields(ranks_), device=first.device, ranks=len(ranks_), rows=rows)
