"""What the benchmark's processes hand each other: one timed step on one rank (`StepSample`), a
rank's steps of one (configuration, M) (`RankRecord`) and everything a rank measured
(`RankResult`), written by `worker.py`; then, merged over ranks by `run.py`, one row per
(configuration, M) (`ConfigResult`), one launch (`Run`) and the whole of `results.json`
(`Results`), read by `report.py`.

Each record is written with `dataclasses.asdict` and read back with its `from_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepSample:
    """One timed optimizer step on one rank."""

    time_s: float
    """Wall time of the step on this rank."""
    cpu_s: float
    """CPU time of this rank's threads (gloo's included) during the step: much less sensitive than
    wall time to other processes competing for the cores."""
    reduce_scatters: int
    """Reduce-scatters this rank issued in the step."""
    all_reduces: int
    """All-reduces this rank issued in the step."""
    all_gathers: int
    """All-gathers this rank issued in the step."""
    bytes_sent: float
    """Bytes this rank sent in the step's collectives, by the ring formula on the tensors given."""
    held_grad_bytes: int
    """The most gradient bytes (sharded and unsharded) held after any backward of the step."""
    held_param_bytes: int
    """The most unsharded parameter bytes alive after any backward of the step."""
    peak_rss_bytes: int
    """Peak resident memory, over the step where the OS allows resetting it, else the process's."""
    rss_growth_bytes: int
    """That peak less the resident memory when the step started."""
    peak_rss_scope: str
    """"step" when the peak was reset at the step's start, "process" when it could not be."""
    device_peak_bytes: int | None
    """The CUDA/NPU allocator's peak in the step; None on CPU."""
    handle_held_grad_bytes: int | None = None
    """The plugin's own measure of the gradient bytes it held (`last_step/held_grad_bytes` of its
    stats); None without the plugin."""
    rep: int = 0
    """The repetition the step belongs to."""
    round: int | None = None
    """The interleaving round the step ran in (None: the Trainer, which runs its own loop)."""


@dataclass
class RankRecord:
    """Every timed step of one (configuration, M) on one rank."""

    config: str
    """Name in `registry.CONFIGS`."""
    M: int
    """Micro-batches per optimizer step."""
    steps: list[StepSample]
    """The timed steps, in the order they ran."""
    stats: dict[str, Any] = field(default_factory=dict)
    """The plugin handle's scalar stats at the end of the run (empty without the plugin)."""
    sync_control_us: float | None = None
    """Microseconds per micro-batch spent choosing and applying the sync mode, without forward or
    backward (`worker.measure_sync_control`); None for the Trainer."""

    @classmethod
    def from_dict(cls, data: dict) -> RankRecord:
        return cls(**{**data, "steps": [StepSample(**s) for s in data["steps"]]})


@dataclass
class RankResult:
    """What one rank of one launch measured: `rank<R>.json`."""

    size: str
    """Model size, a key of `registry.SIZES`."""
    facts: dict[str, Any]
    """The model's and launch's facts: params, units, world size, the full-deferral bytes, the
    size's shape and the planner's reduce-scatter weight on this backend."""
    device: str
    """Device type the rank ran on: cpu, cuda or npu."""
    pinned_core: int | None
    """The CPU core the rank was pinned to (None: not pinned)."""
    records: list[RankRecord]
    """One record per (configuration, M)."""
    versions: dict[str, str]
    """Versions of torch, accelerate, transformers and accel_gradsync, and the process group backend."""

    @classmethod
    def from_dict(cls, data: dict) -> RankResult:
        return cls(**{**data, "records": [RankRecord.from_dict(r) for r in data["records"]]})


@dataclass
class ConfigResult:
    """One (configuration, M) merged over ranks: a row of the report's table."""

    config: str
    """Name in `registry.CONFIGS`."""
    M: int
    """Micro-batches per optimizer step."""
    label: str = ""
    """The configuration's one-line description (`registry.CONFIGS`)."""
    group: str = ""
    """Where it sits in the report: plugin, memory-aware, peer or hsdp."""
    step_time_s: float = 0.0
    """Median over timed steps of a step's time, a step lasting as long as its slowest rank."""
    step_times_s: list[float] = field(default_factory=list)
    """Every timed step's time (slowest rank), in the order they ran."""
    step_rounds: list[int | None] = field(default_factory=list)
    """The round each of those steps ran in (None: the Trainer): the report pairs configurations
    that ran in the same round."""
    step_cpu_s: float = 0.0
    """Median over timed steps of the busiest rank's CPU time."""
    step_cpus_s: list[float] = field(default_factory=list)
    """Every timed step's CPU time (busiest rank)."""
    reduce_scatters_per_step: float = 0
    """Median reduce-scatters per step on rank 0 (every rank issues the same collectives)."""
    all_reduces_per_step: float = 0
    """Median all-reduces per step on rank 0."""
    all_gathers_per_step: float = 0
    """Median all-gathers per step on rank 0."""
    bytes_sent_per_step: float = 0
    """Median bytes rank 0 sent per step (ring formula)."""
    counts_seen_per_step: dict[str, list[int]] = field(default_factory=dict)
    """Collective kind -> the distinct counts seen over rank 0's timed steps: one value when every
    step issued the same number."""
    held_grad_bytes: int = 0
    """The most gradient bytes any rank held between micro-batches, from the tensors."""
    held_param_bytes: int = 0
    """The most unsharded parameter bytes any rank held after a backward, from the tensors."""
    handle_held_grad_bytes: int | None = None
    """The plugin's own measure of the held gradient bytes, max over ranks (None: no plugin)."""
    peak_rss_bytes: int = 0
    """Peak resident memory, max over ranks and steps."""
    rss_growth_bytes: int = 0
    """The most resident memory grew within a step, max over ranks."""
    peak_rss_scope: str = "step"
    """"step" or "process": what the peak RSS spans."""
    device_peak_bytes: int | None = None
    """The CUDA/NPU allocator's peak, max over ranks and steps; None on CPU."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Rank 0's plugin stats at the end of the run."""
    sync_control_us: float | None = None
    """The slowest rank's cost of the sync choice per micro-batch (None: the Trainer)."""


@dataclass
class Run:
    """One launch: one model size on 2 ranks (or 4, the 2x2 HSDP mesh), every configuration and M."""

    size: str
    """Model size, a key of `registry.SIZES`."""
    facts: dict[str, Any]
    """Rank 0's facts (`RankResult.facts`)."""
    device: str
    """cpu, cuda or npu."""
    ranks: int
    """Processes in the launch: 2, or 4 for HSDP."""
    rows: list[ConfigResult]
    """One per (configuration, M)."""
    versions: dict[str, str] = field(default_factory=dict)
    """Rank 0's versions (`RankResult.versions`)."""
    pinned_cores: list[int | None] = field(default_factory=list)
    """Each rank's pinned core."""
    wall_s: float = 0.0
    """Wall time of the launch."""
    link: str | None = None
    """The simulated cluster's link bandwidth in tc's spelling (None: loopback)."""
    hosts: int = 1
    """Simulated hosts the launch spanned."""
    ranks_per_host: int | None = None
    """Ranks on each simulated host (None: loopback)."""
    link_bytes: int | None = None
    """Bytes tbf counted through the shaped links during the launch (None: loopback)."""

    @classmethod
    def from_dict(cls, data: dict) -> Run:
        return cls(**{**data, "rows": [ConfigResult(**r) for r in data["rows"]]})


@dataclass
class Results:
    """Everything `python -m benchmarks.run` measured: `results.json`."""

    command: str
    """The command line that produced it."""
    plan: dict[str, Any]
    """Sizes, Ms, configurations, repetitions and steps the run used (`run.plan`)."""
    machine: dict[str, Any]
    """The machine's CPU, memory, platform and device (`run.machine_facts`)."""
    elapsed_s: float
    """Wall time of the whole run."""
    load_average: dict[str, list[float]]
    """The machine's load average before and after the run."""
    runs: list[Run]
    """One per launch."""

    @classmethod
    def from_dict(cls, data: dict) -> Results:
        return cls(**{**data, "runs": [Run.from_dict(r) for r in data["runs"]]})


# -- the GRPO benchmark (grpo_worker.py -> grpo.py -> grpo_report.py) -----------------------------
@dataclass
class PhaseTotals:
    """Time and collectives of one phase of a GRPO step on one rank."""

    time_s: float = 0.0
    """Wall time charged to the phase."""
    all_gathers: int = 0
    """All-gathers issued in the phase."""
    reduce_scatters: int = 0
    """Reduce-scatters issued in the phase."""
    all_reduces: int = 0
    """All-reduces issued in the phase."""
    bytes_sent: float = 0.0
    """Bytes sent in the phase's collectives (ring formula)."""


@dataclass
class GrpoStep:
    """One timed GRPO optimizer step on one rank."""

    step: int
    """The Trainer's global step."""
    time_s: float
    """Wall time from `on_step_begin` to `on_step_end`."""
    cpu_s: float
    """CPU time of this rank's threads in the step."""
    phases: dict[str, PhaseTotals]
    """generation, logprob, scoring, training -> what the step spent in it."""
    held_grad_bytes: int
    """The most gradient bytes held after any micro-batch of the step."""
    held_param_bytes: int
    """The most unsharded parameter bytes alive after any micro-batch of the step."""
    rss_growth_bytes: int
    """The step's peak resident memory less the resident memory at its start."""

    @classmethod
    def from_dict(cls, data: dict) -> GrpoStep:
        return cls(**{**data, "phases": {k: PhaseTotals(**v) for k, v in data["phases"].items()}})


@dataclass
class GrpoRankRun:
    """One `GRPOTrainer.train()` of one configuration in one round, on one rank."""

    config: str
    """Name in `grpo.CONFIGS`."""
    round: int
    """The round it ran in."""
    steps: list[GrpoStep]
    """The timed steps (step 1, FSDP's lazy init, is left out)."""
    units: int
    """FSDP2 units of the prepared model."""
    logs: list[dict[str, Any]]
    """The Trainer's logged step, loss, reward, reward_std and kl."""
    completions: list[str]
    """A digest of each generation's completion token ids on this rank."""
    completion_tokens: list[int]
    """Completion tokens of each generation on this rank."""
    rewards: list[list[float]]
    """Each scoring's rewards, as computed (gathered over ranks)."""
    handle_held_grad_bytes: int | None = None
    """The plugin's own measure of the gradient bytes it held in the last step (None: no plugin)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """The plugin handle's scalar stats at the end of the run."""

    @classmethod
    def from_dict(cls, data: dict) -> GrpoRankRun:
        return cls(**{**data, "steps": [GrpoStep.from_dict(s) for s in data["steps"]]})


@dataclass
class GrpoRankResult:
    """What one rank of the GRPO launch measured: `rank<R>.json`."""

    size: str
    """Key of `grpo.SIZES`."""
    facts: dict[str, Any]
    """The saved model's facts (`grpo.build_model_dir`)."""
    pinned_core: int | None
    """The CPU core the rank was pinned to (None: not pinned)."""
    runs: list[GrpoRankRun]
    """Every configuration's run in every round, in the order they ran."""
    versions: dict[str, str]
    """Versions of torch, accelerate, transformers, trl, peft and accel_gradsync, and the backend."""

    @classmethod
    def from_dict(cls, data: dict) -> GrpoRankResult:
        return cls(**{**data, "runs": [GrpoRankRun.from_dict(r) for r in data["runs"]]})


@dataclass
class GrpoRow:
    """One GRPO configuration merged over ranks and rounds: a row of the report's table."""

    config: str
    """Name in `grpo.CONFIGS`: tuning/mode."""
    mode: str = ""
    """Key of `grpo.MODES`."""
    lora: bool = False
    """LoRA on q_proj, v_proj (else full fine-tuning)."""
    units: int = 0
    """FSDP2 units of the prepared model."""
    step_time_s: float = 0.0
    """Median over timed steps of a step's time, taken from the slowest rank."""
    step_times_s: list[float] = field(default_factory=list)
    """Every timed step's time (slowest rank)."""
    step_rounds: list[int] = field(default_factory=list)
    """The round of each of those steps."""
    phase_time_s: dict[str, float] = field(default_factory=dict)
    """Phase -> median over the same steps of the time the slowest rank spent in it."""
    counts_seen: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Phase -> collective kind -> the distinct counts seen over rank 0's timed steps."""
    counts_per_step: dict[str, dict[str, float]] = field(default_factory=dict)
    """Phase -> collective kind or bytes_sent -> median per step on rank 0."""
    held_grad_bytes: int = 0
    """The most gradient bytes any rank held after a micro-batch."""
    held_param_bytes: int = 0
    """The most unsharded parameter bytes any rank held after a micro-batch."""
    handle_held_grad_bytes: int | None = None
    """The plugin's own held-gradient measure, max over ranks and rounds (None: no plugin)."""
    rss_growth_bytes: int = 0
    """The most any rank's resident memory grew within a step."""
    logs: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per round, rank 0's logged steps."""
    rewards: list[list[list[float]]] = field(default_factory=list)
    """Per round, rank 0's rewards of each scoring (gathered over ranks)."""
    completions: list[list[list[str]]] = field(default_factory=list)
    """Per round, per rank, the completion digests of each generation."""
    completion_tokens: list[list[int]] = field(default_factory=list)
    """Per round, rank 0's completion tokens of each generation."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Rank 0's plugin stats after its last round."""


@dataclass
class GrpoRun:
    """The GRPO launch on one network: loopback, or a simulated link between 2 hosts."""

    size: str
    """Key of `grpo.SIZES`."""
    facts: dict[str, Any]
    """The saved model's facts (`grpo.build_model_dir`)."""
    rows: list[GrpoRow]
    """One per configuration."""
    versions: dict[str, str] = field(default_factory=dict)
    """Rank 0's versions."""
    pinned_cores: list[int | None] = field(default_factory=list)
    """Each rank's pinned core."""
    link: str | None = None
    """The simulated link's bandwidth in tc's spelling (None: loopback)."""
    link_bytes: int | None = None
    """Bytes tbf counted through the shaped links (None: loopback)."""
    wall_s: float = 0.0
    """Wall time of the launch."""

    @classmethod
    def from_dict(cls, data: dict) -> GrpoRun:
        return cls(**{**data, "rows": [GrpoRow(**r) for r in data["rows"]]})


@dataclass
class GrpoResults:
    """Everything `python -m benchmarks.run --grpo` measured: `results.json`."""

    command: str
    """The command line that produced it."""
    plan: dict[str, Any]
    """Size, configurations, rounds and steps the run used (`grpo.plan_of`)."""
    machine: dict[str, Any]
    """The machine's CPU, memory and platform (`run.machine_facts`)."""
    elapsed_s: float
    """Wall time of the whole run."""
    load_average: dict[str, list[float]]
    """The machine's load average before and after the run."""
    runs: list[GrpoRun]
    """Loopback, then one per simulated link."""
    benchmark: str = "grpo"
    """Tells `python -m benchmarks.report` which report to draw."""

    @classmethod
    def from_dict(cls, data: dict) -> GrpoResults:
        return cls(**{**data, "runs": [GrpoRun.from_dict(r) for r in data["runs"]]})
