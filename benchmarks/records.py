"""What the benchmark's processes hand each other, as typed records: a worker writes its rank's
record (`RankResult`, `GrpoRankResult`) with `dataclasses.asdict`; the harness merges the ranks
into rows (`ConfigResult`, `GrpoRow`), one run per launch and network (GRPO: per network, over its
launches, `GrpoLaunch`), and writes the whole (`Results`, `GrpoResults`) as results.json.
`from_dict` rebuilds any of them from JSON by its type hints, so a new field needs its declaration
only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class Record:
    @classmethod
    def from_dict(cls, data: dict) -> Any:
        return build(cls, data)


def build(tp: Any, value: Any) -> Any:
    """`value` (parsed JSON) as type `tp`: dataclasses, lists, dicts and optionals recursively; fields
    the records no longer declare are left out, so older results.json files still redraw."""
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{k: build(hints[k], v) for k, v in value.items() if k in hints})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [build(args[0], v) for v in value]
    if origin is dict:
        return {k: build(args[1], v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return build(inner, value)
    return value


@dataclass(kw_only=True)
class Measured(Record):
    """One timed optimizer step on one rank (`measure.StepMeter`)."""

    time_s: float
    cpu_s: float  # this rank's CPU time (gloo's threads included): less sensitive to neighbours
    held_grad_bytes: int  # the most gradient bytes (sharded + unsharded) held after any backward
    held_param_bytes: int  # the most unsharded parameter bytes alive after any backward
    rss_growth_bytes: int  # the step's peak resident memory less that at its start


def memory_max(steps: list[Measured], handle_held: list[int | None]) -> dict[str, Any]:
    """A row's memory fields: the max over every rank's steps (None: no plugin measure)."""
    held = [h for h in handle_held if h is not None]
    out = {k: max(getattr(s, k) for s in steps) for k in ("held_grad_bytes", "held_param_bytes", "rss_growth_bytes")}
    return {**out, "handle_held_grad_bytes": max(held) if held else None}


@dataclass(kw_only=True)
class Row(Record):
    """One configuration merged over ranks: a row of a report's table. Times are each step's
    slowest rank; collective counts rank 0's (every rank issues the same); memory the max over ranks."""

    config: str
    step_time_s: float = 0.0  # median over the timed steps
    step_times_s: list[float] = field(default_factory=list)  # every timed step, in the order they ran
    step_rounds: list[int | None] = field(default_factory=list)  # the round each ran in (None: own loop)
    held_grad_bytes: int = 0
    held_param_bytes: int = 0
    handle_held_grad_bytes: int | None = None  # the plugin's own held-gradient measure (None: no plugin)
    rss_growth_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # rank 0's plugin stats at the end (scalars)


@dataclass(kw_only=True)
class RunBase(Record):
    """One launch on one network: loopback, or a simulated cluster's shaped link."""

    size: str
    facts: dict[str, Any]  # the model's and launch's facts (params, units, world size, ...)
    versions: dict[str, str] = field(default_factory=dict)
    pinned_cores: list[int | None] = field(default_factory=list)  # each rank's core (None: unpinned)
    wall_s: float = 0.0
    link: str | None = None  # the link bandwidth in tc's spelling (None: loopback)
    hosts: int = 1
    ranks_per_host: int | None = None
    link_bytes: int | None = None  # bytes tbf counted through the shaped links


@dataclass(kw_only=True)
class RankBase(Record):
    """What a rank's record says of its launch besides its measures."""

    size: str
    facts: dict[str, Any]
    pinned_core: int | None
    versions: dict[str, str]


def launch_fields(ranks: list[RankBase]) -> dict[str, Any]:
    """The `RunBase` fields a launch's ranks give: rank 0's size, facts and versions, every rank's core."""
    first = ranks[0]
    return dict(
        size=first.size, facts=first.facts, versions=first.versions, pinned_cores=[r.pinned_core for r in ranks]
    )


@dataclass(kw_only=True)
class ResultsBase(Record):
    """Everything one `python -m benchmarks.run` measured: results.json."""

    command: str
    plan: dict[str, Any]  # sizes, Ms, configurations, rounds, steps, quick
    machine: dict[str, Any]  # `run.machine_facts`
    elapsed_s: float


# -- the MLP benchmark (mlp_worker.py -> mlp.py -> mlp_report.py) --------------------------------
@dataclass(kw_only=True)
class StepSample(Measured):
    reduce_scatters: int
    all_reduces: int
    all_gathers: int
    bytes_sent: float  # by the ring formula on the tensors the collectives were given
    device_peak_bytes: int | None  # the CUDA/NPU allocator's peak; None on CPU
    handle_held_grad_bytes: int | None = None
    rep: int = 0
    round: int | None = None  # the interleaving round


@dataclass(kw_only=True)
class RankRecord(Record):
    config: str
    M: int
    steps: list[StepSample]
    stats: dict[str, Any] = field(default_factory=dict)
    sync_control_us: float | None = None  # `mlp_worker.measure_sync_control`


@dataclass(kw_only=True)
class RankResult(RankBase):
    device: str
    records: list[RankRecord]


@dataclass(kw_only=True)
class ConfigResult(Row):
    M: int
    step_cpu_s: float = 0.0
    step_cpus_s: list[float] = field(default_factory=list)
    reduce_scatters_per_step: float = 0
    all_reduces_per_step: float = 0
    all_gathers_per_step: float = 0
    bytes_sent_per_step: float = 0
    counts_seen_per_step: dict[str, list[int]] = field(default_factory=dict)  # kind -> distinct counts seen
    device_peak_bytes: int | None = None
    sync_control_us: float | None = None  # the slowest rank's


@dataclass(kw_only=True)
class Run(RunBase):
    device: str
    ranks: int  # 2, or 4 for the 2x2 HSDP mesh
    rows: list[ConfigResult]


@dataclass(kw_only=True)
class Results(ResultsBase):
    runs: list[Run]
    benchmark: str = "mlp"


# -- the GRPO benchmark (grpo_worker.py -> grpo.py -> grpo_report.py) ------------------------------
@dataclass(kw_only=True)
class PhaseTotals(Record):
    time_s: float = 0.0
    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    bytes_sent: float = 0.0


@dataclass(kw_only=True)
class GrpoStep(Measured):
    step: int  # the Trainer's global step
    phases: dict[str, PhaseTotals]  # generation, logprob, scoring, training
    state_bytes: int = 0  # after the optimizer step: this rank's params, grads and optimizer state, both models
    ref_unsharded_bytes: int = 0  # of those, the reference model's unsharded parameters still allocated


@dataclass(kw_only=True)
class GrpoRankRun(Record):
    """One `GRPOTrainer.train()` of one configuration in one round, on one rank."""

    config: str
    round: int
    steps: list[GrpoStep]  # step 1 (FSDP's lazy init) left out
    units: int  # FSDP2 units of the prepared model
    first_step: GrpoStep | None = None  # step 1, untimed: its counts (a resident reference model's gather)
    ref_units: int = 0  # FSDP2 units of a reference model of its own (TRL's ref_model); 0: none, or DDP
    logs: list[dict[str, Any]]  # the Trainer's logged step, loss, reward, reward_std, kl
    completions: list[str]  # a digest of each generation's completion ids
    rewards: list[list[float]]  # each scoring's rewards, gathered over ranks
    handle_held_grad_bytes: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class GrpoRankResult(RankBase):
    runs: list[GrpoRankRun]
    backend_ms: dict[str, float] = field(default_factory=dict)
    """Median ms of one all-gather, reduce-scatter and all-reduce of the model's fp32 params on
    this launch's process group (`grpo_worker.time_collectives`; FSDP2's launches only)."""


@dataclass(kw_only=True)
class GrpoLaunch(RunBase):
    """One launch's ranks, as they wrote them (a round of FSDP2's or of DDP's configurations):
    `grpo.combine` merges a network's launches into its `GrpoRun`; never in results.json."""

    ranks: list[GrpoRankResult]


@dataclass(kw_only=True)
class GrpoRow(Row):
    units: int = 0
    ref_units: int = 0  # FSDP2 units of a reference model of its own (0: none, as under LoRA or beta 0; DDP)
    state_bytes: int = 0  # the most `GrpoStep.state_bytes` over ranks and steps: what stays between steps
    ref_unsharded_bytes: int = 0  # the most `GrpoStep.ref_unsharded_bytes`: a resident reference model's share
    resident_units: int = 0  # units of the trained model kept unsharded for the run (keep_frozen_unsharded)
    resident_bytes: int = 0  # their unsharded parameter bytes per rank (stats()'s resident_param_bytes)
    # Per round, rank 0's all-gathers in the log-prob passes at every step, step 1 included (counted
    # around `torch.distributed`): with beta > 0 under full fine-tuning, the reference model's.
    logprob_gathers: list[list[int]] = field(default_factory=list)
    phase_time_s: dict[str, float] = field(default_factory=dict)  # phase -> median over the steps
    counts_seen: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # phase -> kind -> seen
    counts_per_step: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> kind -> median
    # Per round, what must equal stock's: rank 0's logs and rewards, every rank's completion digests.
    logs: list[list[dict[str, Any]]] = field(default_factory=list)
    rewards: list[list[list[float]]] = field(default_factory=list)
    completions: list[list[list[str]]] = field(default_factory=list)


@dataclass(kw_only=True)
class GrpoRun(RunBase):
    rows: list[GrpoRow]
    backend_ms: dict[str, float] = field(default_factory=dict)  # rank 0's of the first launch


@dataclass(kw_only=True)
class GrpoResults(ResultsBase):
    runs: list[GrpoRun]
    benchmark: str = "grpo"
