"""The MLP benchmark: every sync mode of the plugin against the loops a user would otherwise
write (stock accelerate, the transformers Trainer, hand-written FSDP2 loops), on residual MLPs
of several sizes; over loopback, or with `--cluster` on simulated hosts. This module holds the
configurations, the run plans, the launches and the merge of the ranks' records; `mlp_worker.py`
measures, `mlp_report.py` reports.

A configuration (`CONFIGS`) is a dict: `loop`, the training loop that drives it
(`mlp_worker.LOOPS`, or "trainer" for a stock `transformers.Trainer`); `gradsync`, the
`GradSyncConfig` arguments, a function of the model's facts returning them, or None (no plugin);
`sync_each_batch` (accelerate's plugin flag); `reshard_after_forward: False` (what
`fsdp_reshard_after_forward: false` gives FSDP2's units); `mesh: "2x2"` (4 ranks as HSDP,
replicate 2 x shard 2; else 2 ranks of plain FSDP2); `group` and `label` for the report.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.records import ConfigResult, RankResult, Run

WORKER = Path(__file__).with_name("mlp_worker.py")
KINDS = ("reduce_scatters", "all_reduces", "all_gathers")


def budget(fraction: float) -> Callable[[dict], dict]:
    """A budget of `fraction` x the bytes a full window holds on one rank (every unit's unsharded
    gradient and params): the budget modes choose each unit's level inside that span."""

    def build(facts: dict) -> dict:
        return {"sync_mode": "budget", "memory_budget": f"{int(fraction * facts['full_window_bytes'])}B"}

    return build


CONFIGS: dict[str, dict[str, Any]] = {
    # The two modes of the plugin, through accelerate's own `accumulate`.
    "per_micro_batch": {"loop": "accumulate", "gradsync": {"defer": False}, "group": "plugin",
                        "label": "accel_gradsync per-micro-batch"},
    "deferred": {"loop": "accumulate", "gradsync": {"defer": True}, "group": "plugin",
                 "label": "accel_gradsync deferred"},
    "window": {"loop": "accumulate", "gradsync": {"defer": True, "keep_params_unsharded": True}, "group": "plugin",
               "label": "accel_gradsync deferred + window (params unsharded through the window)"},
    # Memory-aware modes: each defers only what fits.
    "budget_25": {"loop": "accumulate", "gradsync": budget(0.25), "group": "memory-aware",
                  "label": "budget = 25% of a full window's bytes"},
    "budget_50": {"loop": "accumulate", "gradsync": budget(0.50), "group": "memory-aware",
                  "label": "budget = 50% of a full window's bytes"},
    "budget_75": {"loop": "accumulate", "gradsync": budget(0.75), "group": "memory-aware",
                  "label": "budget = 75% of a full window's bytes"},
    "auto": {"loop": "accumulate", "gradsync": {"sync_mode": "auto"}, "group": "memory-aware",
             "label": "auto (from free memory)"},
    # The peers a user would otherwise pick.
    "stock_accumulate": {"loop": "accumulate", "gradsync": None, "group": "peer",
                         "label": "stock accelerate accumulate (no plugin)"},
    "stock_sync_each_batch": {"loop": "accumulate", "gradsync": None, "sync_each_batch": True, "group": "peer",
                              "label": "stock accelerate, sync_each_batch=True"},
    "raw_fsdp2": {"loop": "raw", "gradsync": None, "group": "peer",
                  "label": "hand-written set_requires_gradient_sync loop (verl)"},
    "raw_window": {"loop": "raw_window", "gradsync": None, "reshard_after_forward": False, "group": "peer",
                   "label": "hand-written window loop (PyTorch issue 124319)"},
    "stock_window_by_hand": {"loop": "accumulate_window", "gradsync": None, "reshard_after_forward": False,
                             "group": "peer",
                             "label": "stock accelerate accumulate, window flags by hand (PyTorch issue 124319)"},
    "stock_no_reshard": {"loop": "accumulate", "gradsync": None, "reshard_after_forward": False, "group": "peer",
                         "label": "stock accelerate accumulate, fsdp_reshard_after_forward: false"},
    "trainer_stock": {"loop": "trainer", "gradsync": None, "group": "peer",
                      "label": "stock transformers Trainer"},
    # HSDP on a 2x2 (replicate x shard) mesh, 4 ranks.
    "hsdp_per_micro_batch": {"loop": "accumulate", "gradsync": {"defer": False}, "mesh": "2x2", "group": "hsdp",
                             "label": "HSDP 2x2 per-micro-batch"},
    "hsdp_deferred": {"loop": "accumulate", "gradsync": {"defer": True}, "mesh": "2x2", "group": "hsdp",
                      "label": "HSDP 2x2 deferred"},
    "hsdp_defer_all_reduce": {"loop": "accumulate", "gradsync": {"sync_mode": "defer_all_reduce"}, "mesh": "2x2",
                              "group": "hsdp", "label": "HSDP 2x2 all-reduce deferral"},
}  # fmt: skip

# The overhead pairs: configurations that issue the same collectives on the same bytes, so
# their step times differ only by what the wrapper costs. The worker runs each pair back to
# back in every round and the report compares them round by round.
PAIRS: tuple[tuple[str, str], ...] = (
    ("deferred", "raw_fsdp2"),
    ("per_micro_batch", "stock_sync_each_batch"),
    ("window", "raw_window"),
    # The same window flags by hand, in accelerate's own loop: what the plugin adds to that loop,
    # apart from what the loop itself costs against `raw_window`.
    ("window", "stock_window_by_hand"),
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

QUICK = {"sizes": ["small"], "Ms": [1, 2, 4], "reps": 1, "steps": 2, "configs": [
    "per_micro_batch", "deferred", "window", "budget_50", "stock_accumulate", "stock_sync_each_batch", "raw_fsdp2",
    "raw_window"]}  # fmt: skip
# steps None: each size's own `steps` (a full run must fit 10 minutes on 2 cores).
FULL = {"sizes": ["small", "large"], "Ms": [1, 2, 4, 8], "configs": list(CONFIGS), "reps": 1, "steps": None}


def gradsync_kwargs(name: str, facts: dict) -> dict | None:
    """The GradSyncConfig arguments of a configuration, for this model."""
    spec = CONFIGS[name]["gradsync"]
    return spec(facts) if callable(spec) else spec


def ranks(name: str) -> int:
    return 4 if CONFIGS[name].get("mesh") == "2x2" else 2


# The simulated cluster (`--cluster 2x1`), run once per link bandwidth: every sync mode and peer
# across 2 hosts, and the HSDP mesh as 2 hosts x 2 ranks. The medium model and M = 1, 4, 8 keep a
# run of two links within the full run's time target on 2 cores.
CLUSTER = {"sizes": ["medium"], "Ms": [1, 4, 8], "reps": 1, "steps": 2, "configs": [
    "per_micro_batch", "deferred", "window", "budget_50", "auto", "stock_accumulate", "raw_fsdp2", "raw_window",
    "hsdp_per_micro_batch", "hsdp_deferred", "hsdp_defer_all_reduce"]}  # fmt: skip
CLUSTER_QUICK = {"sizes": ["small"], "Ms": [1, 4], "reps": 1, "steps": 1, "hsdp_size": "small", "configs": [
    "per_micro_batch", "deferred", "window", "hsdp_per_micro_batch", "hsdp_defer_all_reduce"]}  # fmt: skip


def pair_chains(names: list[str]) -> list[list[str]]:
    """The overhead pairs among `names` as chains of adjacent configurations: a configuration in
    two pairs (the window, against the raw loop and against the flags by hand) sits between its
    two partners."""
    chains: list[list[str]] = []
    for a, b in PAIRS:
        if a not in names or b not in names:
            continue
        chain = next((c for c in chains if a in c and a in (c[0], c[-1])), None)
        if chain is None:
            chains.append([a, b])
        elif chain[0] == a:
            chain.insert(0, b)
        else:
            chain.append(b)
    return chains


def round_order(names: list[str], k: int) -> list[str]:
    """Round k's order: the overhead pairs as adjacent blocks (as listed on even rounds, reversed
    on odd ones, so no configuration always runs first), every other configuration a block of its
    own, and the blocks rotated by k."""
    blocks = [chain if k % 2 == 0 else chain[::-1] for chain in pair_chains(names)]
    done = {name for block in blocks for name in block}
    blocks += [[name] for name in names if name not in done]
    if not blocks:
        return []
    k %= len(blocks)
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
    slowest rank, the median is over all timed steps; counts and bytes are rank 0's (every rank
    issues the same collectives), memory the max over ranks."""
    ranks_ = [RankResult.from_dict(r) for r in ranks_json]
    first, rows = ranks_[0], []
    for j, rec in enumerate(first.records):
        per_rank = [rank.records[j] for rank in ranks_]
        assert all((r.config, r.M) == (rec.config, rec.M) for r in per_rank), "ranks disagree on the records"
        steps = list(zip(*(r.steps for r in per_rank), strict=True))  # each timed step, on every rank
        times = [max(s.time_s for s in step) for step in steps]
        cpus = [max(s.cpu_s for s in step) for step in steps]
        every = [s for r in per_rank for s in r.steps]
        handle_held = [s.handle_held_grad_bytes for s in every if s.handle_held_grad_bytes is not None]
        rows.append(
            ConfigResult(
                config=rec.config,
                M=rec.M,
                label=CONFIGS[rec.config]["label"],
                group=CONFIGS[rec.config]["group"],
                step_time_s=statistics.median(times),
                step_times_s=times,
                step_rounds=[s.round for s in rec.steps],
                step_cpu_s=statistics.median(cpus),
                step_cpus_s=cpus,
                **{f"{kind}_per_step": statistics.median(getattr(s, kind) for s in rec.steps) for kind in KINDS},
                bytes_sent_per_step=statistics.median(s.bytes_sent for s in rec.steps),
                counts_seen_per_step={kind: sorted({getattr(s, kind) for s in rec.steps}) for kind in KINDS},
                held_grad_bytes=max(s.held_grad_bytes for s in every),
                held_param_bytes=max(s.held_param_bytes for s in every),
                handle_held_grad_bytes=max(handle_held) if handle_held else None,
                peak_rss_bytes=max(s.peak_rss_bytes for s in every),
                rss_growth_bytes=max(s.rss_growth_bytes for s in every),
                peak_rss_scope=rec.steps[0].peak_rss_scope,
                device_peak_bytes=max((s.device_peak_bytes or 0) for s in every) or None,
                stats=rec.stats,
                sync_control_us=max((r.sync_control_us or 0) for r in per_rank) or None,
            )
        )
    return Run(size=first.size, facts=first.facts, device=first.device, ranks=len(ranks_), rows=rows,
               versions=first.versions, pinned_cores=[rank.pinned_core for rank in ranks_])  # fmt: skip
