"""Every configuration the benchmark runs, as one plain dict: name -> how to build the run.

Keys of an entry:
- `loop`: which training loop drives it (`worker.LOOPS`): "accumulate" (accelerate's
  `accumulate`, with or without the plugin), "accumulate_window" (the same, with the window's
  flags flipped by hand), "raw" / "raw_window" (hand-written FSDP2 loops) or "trainer"
  (a stock `transformers.Trainer`).
- `gradsync`: keyword arguments for `accel_gradsync.GradSyncConfig`, or a function of the
  model's facts returning them (the budget modes size their budget from the full-deferral
  gradient bytes), or None for "no plugin attached".
- `sync_each_batch`: accelerate's `GradientAccumulationPlugin(sync_each_batch=True)`.
- `reshard_after_forward`: False applies what `fsdp_reshard_after_forward: false` in the
  accelerate config gives FSDP2's units (`set_reshard_after_forward(False)` after prepare).
- `mesh`: "2x2" runs it on 4 ranks as HSDP (accelerate's parallelism_config, replicate 2 x
  shard 2); absent: 2 ranks, plain FSDP2.
- `group`: where it sits in the report ("plugin", "memory-aware", "peer", "hsdp").
- `label`: one line for the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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

# Model sizes: `dim` x `layers` residual MLP blocks and a root of the same size (8 dim^2 + 5 dim
# parameters each; model.py).
# `rows` per micro-batch is small on purpose for "large": little compute per parameter, so
# gloo's reduce-scatter dominates (the communication-bound case). `steps`: timed rounds per M
# in the full run; the small model's steps are cheap, and its many rounds are what resolves a
# wrapper's per-micro-batch cost, which is the largest share of the shortest step.
SIZES: dict[str, dict[str, int]] = {
    "small": {"dim": 128, "layers": 4, "rows": 64, "steps": 36},
    "medium": {"dim": 384, "layers": 4, "rows": 8, "steps": 3},
    "large": {"dim": 720, "layers": 4, "rows": 8, "steps": 3},
}

# HSDP runs 4 processes on the machine: one (communication-bound) size shows the trade-off.
HSDP_SIZE = "medium"

QUICK = {
    "sizes": ["small"],
    "Ms": [1, 2, 4],
    "configs": [
        "per_micro_batch",
        "deferred",
        "window",
        "budget_50",
        "stock_accumulate",
        "stock_sync_each_batch",
        "raw_fsdp2",
        "raw_window",
    ],
    "reps": 1,
    "steps": 2,
}
# steps None: each size's own `steps` (a full run must fit 10 minutes on 2 cores).
FULL = {"sizes": ["small", "large"], "Ms": [1, 2, 4, 8], "configs": list(CONFIGS), "reps": 1, "steps": None}


def gradsync_kwargs(name: str, facts: dict) -> dict | None:
    """The GradSyncConfig arguments of a configuration, for this model."""
    spec = CONFIGS[name]["gradsync"]
    return spec(facts) if callable(spec) else spec


def ranks(name: str) -> int:
    return 4 if CONFIGS[name].get("mesh") == "2x2" else 2


# The simulated cluster (`--cluster 2x1`, benchmarks/cluster.py), run once per link bandwidth:
# every sync mode and peer across 2 hosts, and the HSDP mesh as 2 hosts x 2 ranks. The medium
# model and M = 1, 4, 8 keep the run (two links) within 10 minutes on 2 cores; the large model's
# per-micro-batch step alone takes ~14 s on a 1 Gbit/s link.
CLUSTER = {
    "sizes": ["medium"],
    "Ms": [1, 4, 8],
    "configs": [
        "per_micro_batch",
        "deferred",
        "window",
        "budget_50",
        "auto",
        "stock_accumulate",
        "raw_fsdp2",
        "raw_window",
        "hsdp_per_micro_batch",
        "hsdp_deferred",
        "hsdp_defer_all_reduce",
    ],
    "reps": 1,
    "steps": 2,
}
CLUSTER_QUICK = {
    "sizes": ["small"],
    "Ms": [1, 4],
    "configs": ["per_micro_batch", "deferred", "window", "hsdp_per_micro_batch", "hsdp_defer_all_reduce"],
    "reps": 1,
    "steps": 1,
    "hsdp_size": "small",
}
