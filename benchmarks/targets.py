"""Every PASS/FAIL target of the benchmarks, in one place: what each compares, its threshold and
why; `mlp_report.py` and `grpo_report.py` measure. A timing target is judged on the median of paired
ratios (`stats.median_ci`): a full run decides on the median; a quick run (`--quick`) passes or fails
only where the whole bootstrap interval lies on one side of the threshold, else reports `N/D`.
"""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIP, UNDECIDED = "PASS", "FAIL", "SKIP", "N/D"
UNDECIDED_NOTE = "not decided at this size"
# Below this many paired ratios a percentile bootstrap interval is degenerate (one ratio gives a
# zero-width interval): a quick run with fewer leaves the target undecided.
MIN_SAMPLES = 4


@dataclass(frozen=True)
class Target:
    """A measured value must lie in [lower, upper] (None: unbounded on that side)."""

    name: str  # what the target says, as the summary line starts
    compares: str  # the value judged: which configurations, paired how, at which M
    why: str  # why the threshold is where it is
    lower: float | None = None
    upper: float | None = None

    def passes(self, value: float) -> bool:
        return (self.lower is None or value >= self.lower) and (self.upper is None or value <= self.upper)

    def judge(self, median: float, low: float, high: float, n: int, quick: bool) -> str:
        """PASS / FAIL on the median; on a quick run, N/D unless the interval [low, high] of n
        values lies wholly inside or wholly on one side outside the passing range."""
        if not quick:
            return PASS if self.passes(median) else FAIL
        if n < MIN_SAMPLES:
            return UNDECIDED
        if self.passes(low) and self.passes(high):
            return PASS
        below = self.lower is not None and high < self.lower
        above = self.upper is not None and low > self.upper
        return FAIL if below or above else UNDECIDED


@dataclass
class TargetResult:
    """One line of the summary: the target (with where it was measured), PASS, FAIL, SKIP (not
    run) or N/D (a quick run too small to decide), and the figures it was judged on."""

    target: str
    status: str
    measured: str


def worst(statuses: list[str]) -> str:
    """One status for a target judged in several parts: FAIL over N/D over PASS."""
    for status in (FAIL, UNDECIDED, SKIP):
        if status in statuses:
            return status
    return PASS


def format_summary(results: list[TargetResult]) -> str:
    lines = ["Targets:"] + [f"  [{r.status}] {r.target}: {r.measured}" for r in results]
    return "\n".join(lines)


# Target(name: the summary line's start, compares: the value judged, why: the threshold's reason,
# lower, upper: the passing bounds). fmt: off keeps each target's strings together.
# fmt: off
# -- the MLP benchmark over loopback (mlp_report.py) --------------------------------------------------
OVERHEAD_TOLERANCE, CLEAR_MARGIN = 0.02, 1.10
WRAPPER_OVERHEAD = Target("the plugin within 2% of the same collectives without it",
    "the plugin's step / the same collectives without it (a hand-written FSDP2 loop, or stock accelerate with "
    "the same flags), paired by round and pooled over M, per model",
    "both issue the same collectives on the same bytes, so the ratio is what the wrapper costs; 2% is the "
    "resolution the full run's rounds of the small model are sized for", upper=1 + OVERHEAD_TOLERANCE)
SYNC_CONTROL = Target("the sync choice's own cost within 2% of a step",
    "(plugin - peer) microseconds per micro-batch of a bare `accumulate` x M, over the peer's step at the largest M",
    "the whole of what a wrapper can add, measured apart from steps whose wall time varies by more",
    upper=OVERHEAD_TOLERANCE)
PLANNER_COST = Target("the planner's reduce-scatter weight within a factor 1.6 of what the steps paid",
    "(time deferral saved per reduce-scatter byte) / (time windowing saved per all-gather byte) at the largest "
    "M, over `accel_gradsync.planning.costs.REDUCE_SCATTER_COST` for the backend",
    "the planner uses one figure per backend for every model size; the band allows for the spread between sizes",
    lower=1 / 1.6, upper=1.6)
DEFERRED_SPEEDUP = Target("deferred faster than per-micro-batch at M=4, 8 on the communication-bound model",
    "per-micro-batch step / deferred step, paired by round, at M = 4 and at M = 8",
    "a clear margin, at least 10% less step time, where reduce-scatters dominate the step", lower=CLEAR_MARGIN)
WINDOWED_SPEEDUP = Target("windowed at least 4x faster than per-micro-batch at M=8",
    "per-micro-batch step / windowed step, paired by round, at M = 8, on the large model",
    "windowed removes M-1 of M all-gathers and reduce-scatters per unit; at M = 8 on a communication-bound "
    "model that is most of the step", lower=4.0)
FRONTIER = Target("budget modes on or inside the per-micro-batch - deferred - windowed frontier",
    "per round, (budget step - the frontier's step at its held bytes) / per-micro-batch step, the frontier drawn "
    "from the same round's corners, pooled over M >= 2",
    "budget modes choose whole units' levels, so with equal blocks the point lies on a line; the 2% slack is "
    "the resolution, not a bias", upper=0.02)
HSDP_SPEEDUP = Target("HSDP all-reduce deferral faster than per-micro-batch at no extra held memory",
    "HSDP all-reduce deferral step / HSDP per-micro-batch step, paired by round, pooled over M >= 2; and the "
    "held gradient bytes at every M",
    "deferring only the cross-replica all-reduce keeps the gradients sharded, so it must save time without "
    "holding more", upper=1.0)
COLLECTIVE_COUNTS = Target(
    "reduce-scatters per step: per-micro-batch M x U, deferred U, exactly (HSDP: all-reduces too)",
    "the counts on every timed step against the formula of each configuration",
    "counts are exact: any difference is a defect, never noise")
WINDOWED_GATHERS = Target("windowed: all-gathers per step = U exactly (one per unit), every M",
    "all-gathers on every timed step of the windowed configurations",
    "windowed's point: each unit gathered once per optimizer step, whatever M is")
# The whole run's wall time on 2 cores: the quick run is CI's smoke test, the full run fits 10 minutes.
RUN_TIME_S = {"quick": 120, "full": 600}
# -- the MLP benchmark on the simulated cluster (mlp_report.py) ----------------------------------------
CLUSTER_SPEEDUP = Target("ahead of per-micro-batch by a clear margin (>= 1.1x)",
    "per-micro-batch step / deferred or windowed step, paired by round, pooled over M >= 4, on each simulated link",
    "on a link between hosts the reduce-scatters deferral removes are what a step waits on", lower=CLEAR_MARGIN)
LINK_CROSSED = Target("collectives crossed the shaped link",
    "bytes tbf counted on the hosts' NICs against the ring bytes of the timed steps' collectives",
    "with one rank per host every collective crosses the link; less than the ring bytes means the run did not "
    "use it")
# -- the GRPO benchmark (grpo_report.py): windowed's speedup over loopback (None) and per link -------
GRPO_WINDOWED_SPEEDUP = {
    None: Target("at least 3x faster per GRPO step than stock",
        "stock's step / windowed's step, the median over rounds of each round's medians",
        "stock FSDP2 all-gathers every unit at every decode step and micro-batch; windowed once per step",
        lower=3.0),
    "1gbit": Target("at least 5x faster per GRPO step than stock",
        "stock's step / windowed's step, the median over rounds of each round's medians",
        "on a link between hosts the all-gathers windowed removes are a larger share of the step", lower=5.0),
}
GRPO_WINDOWED_GATHERS = Target("the trained model's all-gathers per optimizer step = U exactly",
    "generation's and training's all-gathers of the trained model on every timed step",
    "windowed gathers each unit once, at generation's first forward, and keeps it to the optimizer step; "
    "U counts the units not kept unsharded for the run (LoRA's frozen base with keep_frozen_unsharded)")
GRPO_GENERATION_ALL_REDUCES = Target("generation issues no all-reduce per decoded token",
    "the all-reduces issued inside TRL's _generate on every timed step, counted around torch.distributed on rank 0",
    "with every unit kept unsharded after generation's first forward no rank's forward issues a collective, so "
    "transformers' per-token synced_gpus all-reduce (on for any FSDP model) is skipped: as under DDP, none; "
    "where the forwards draw random numbers (LoRA's dropout) one per generation, the most forwards of any rank, "
    "so the rank done first replays what it draws under the sync")
GRPO_REFERENCE_RESIDENT = Target("the reference model's all-gathers per step = 0 after step 1 (kept resident)",
    "the log-prob passes' all-gathers at every step of every round, step 1 included, counted around "
    "torch.distributed on rank 0: each of the reference model's units once at step 1, none after",
    "keep_reference_unsharded gathers a frozen reference model at its first forward and keeps it for the run, "
    "as DDP replicates it: no collective for it per step; counts are exact")
GRPO_DDP_FLOOR = Target("within 1.10x of DDP's GRPO step (the data-parallel floor)",
    "windowed's step / DDP's step, the median over rounds of each round's medians (DDP: its own launch, "
    "right after FSDP2's launch of the same round)",
    "DDP replicates the parameters and all-reduces the gradients once per step: the same bytes as windowed's U "
    "all-gathers and U reduce-scatters; no data-parallel step does better on a model that fits", upper=1.10)
GRPO_STATE = Target("memory between optimizer steps below DDP's",
    "each rank's params (FSDP2: shards plus unsharded storage still allocated), grads and optimizer state, of "
    "both models, after every timed optimizer step, the max; of it, the reference model's unsharded params",
    "windowed gathers the trained model within a step only and keeps FSDP's 1/N shard between steps where "
    "DDP keeps everything; a reference model kept resident adds its unsharded params, which DDP holds too; "
    "LoRA's frozen base kept unsharded (keep_frozen_unsharded) is said apart and left out of the comparison")
GRPO_IDENTICAL = Target("completions, rewards, KL and losses identical to stock at every logged step (exact; "
    "logged values within 1e-4 relative where gradients are summed in another order)",
    "every configuration's completion digests, rewards and logged values (loss, reward, reward_std, kl with "
    "beta > 0) against stock's; exact where the "
    "gradients are summed as stock sums them (deferral: deferred, windowed, deferred_gen_resident)",
    "the sync mode changes when gradients are reduced, never what is computed; per-micro-batch sync (and "
    "auto's measured step 1) adds reduced shards, DDP pre-divides before its all-reduce: the same sum in "
    "another floating-point order")
# fmt: on
