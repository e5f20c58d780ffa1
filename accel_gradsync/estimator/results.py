"""What `estimate` returns: `Estimate` (the launch it planned for and its units) holding one
`ModeEstimate` row per sync mode. Plain dataclasses: `--json` prints `Estimate.to_dict()`, so a
field added here is a new JSON key and, where formatting.py shows it, a new table column.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ModeEstimate:
    """One row of the table: one sync mode's cost per optimizer step, per rank."""

    mode: str
    applicable: bool = True
    reason: str = ""
    units_held: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    send_bytes: int = 0
    held_bytes: int = 0
    """Gradient bytes held per rank between micro-batches."""
    held_dtype: str = ""
    """The dtype held gradients are summed in over the micro-batches (FSDP2: the reduce dtype)."""
    held_bytes_compute_dtype: int = 0
    """The same gradients in the compute dtype where they are held wider (fp32 over bf16 compute:
    what `reduce_dtype=bf16` would hold); 0 where they are held in the compute dtype already."""
    held_param_bytes: int = 0
    """Unsharded parameter bytes the windowed units keep per rank through the window."""
    sharded_bytes: int = 0
    """Sharded gradients the units that sync every micro-batch keep between micro-batches."""
    peak_bytes: int = 0
    all_gathers: int = 0
    """Parameter all-gathers per optimizer step (forward, and backward after a reshard)."""
    all_gather_bytes: int = 0
    generation_bytes: int = 0
    """Unsharded parameter bytes per rank held while generating (`gather_for_generation`; 0 when off)."""
    generation_all_gathers: int = 0
    """All-gathers of generation: per token, or per round with `gather_for_generation`."""
    generation_first_all_gathers: int = 0
    """All-gathers of generation's first forward (every unit; the decision line's "first forward's")."""
    generation_all_gathers_in_window: int | None = None
    """Per token when TRL generates inside the window (windowed units stay unsharded); None without
    windowed units or with `gather_for_generation`."""
    reference_resident: bool | None = None
    """GRPO's reference model (`--beta`) kept unsharded for the run under this row's mode
    (residency.py); None without one to count (no --beta, LoRA, not estimated)."""
    reference_all_gathers: int | None = None
    """The reference model's all-gathers per step under this row's mode (resident: after step 1)."""
    units_resident: int = 0
    """Frozen units `keep_frozen_unsharded` keeps unsharded for the run under this row's mode
    (stats()' `units_resident`): gathered once, at step 1's first forward, then never."""
    resident_param_bytes: int = 0
    """Their unsharded params per rank, in the compute dtype (stats()' `resident_param_bytes`)."""
    resident_units: list = field(default_factory=list)
    """Their names ("<root>" for the root), in model order."""
    resident_dtype: str = ""
    """The dtype they are kept in (the compute dtype); "" where none is kept."""
    first_step_all_gathers: int = 0
    """All-gathers of the run's first step: `all_gathers` plus one per kept unit (its only one)."""
    fits: bool | None = None
    """max(peak_bytes + resident_param_bytes, generation_bytes + held gradients) <= free memory x
    (1 - memory_margin); None without --grad-sync-free-memory."""
    selected: bool = False
    step_peak_bytes: int | None = None
    """The whole optimizer step's peak bytes per rank (step_peak.py); None where it was not asked
    for (--micro-batch-size/--seq-len) or could not be computed (`step_peak_unmodeled` says why)."""
    step_peak_phase: str = ""
    """Where the peak falls: first_micro_batch, later_micro_batch, optimizer_step, generation or
    reference_pass (`--beta`)."""
    step_peak_parts: dict = field(default_factory=dict)
    """The peak's persistent parts and one micro-batch's activations, bytes per rank."""
    step_peak_unmodeled: list = field(default_factory=list)
    """Components the forecast could not compute: not in `step_peak_bytes`."""


@dataclass
class ReferenceEstimate:
    """GRPO's reference model (`--beta` > 0) under the selected sync mode (each row holds its own
    mode's residency and all-gathers): the plugin gathers it once per step, or once for the run
    where it is resident (reference.py). Counts and bytes per rank per optimizer step."""

    beta: float
    line: str
    """The header's line: a live run's own (`decision.describe_frozen`), or why there is none."""
    estimated: bool = True
    """False where the launch's reference model is not built here (FSDP1, transformers-sharded)."""
    policy_adapter_off: bool = False
    """LoRA: no second model, the reference pass is the policy with its adapter disabled."""
    units: int = 0
    keeps: bool = False
    """Its units stay unsharded across the step's log-prob pass (`decision.frozen_keeps`)."""
    resident: bool = False
    """Its units stay unsharded for the whole run (`keep_reference_unsharded`, decided for the
    sync mode counted: residency.py)."""
    all_gathers_per_step: int = 0
    """With the plugin: `reference_all_gathers` per step in stats() (resident: after step 1)."""
    first_step_all_gathers: int = 0
    """Resident: what its first forward gathers, in step 1 only (0 where it is not resident)."""
    stock_all_gathers_per_step: int = 0
    """Without it: one log-prob forward per micro-batch, each gathering every unit."""
    sharded_param_bytes: int = 0
    """Its sharded params, resident the whole step."""
    unsharded_param_bytes: int = 0
    """What its log-prob pass holds unsharded: every unit where it keeps them, else its largest unit."""
    reserved_bytes: int = 0
    """What budget and auto plan the trained model within memory less (`residency.kept_bytes`)."""
    send_bytes_per_step: int = 0
    """Bytes one rank sends for its all-gathers with the plugin (ring: (N-1)/N of each gather)."""


_STEP_PEAK_KEYS = ("step_peak_bytes", "step_peak_phase", "step_peak_parts", "step_peak_unmodeled")
_RESIDENT_KEYS = (
    "units_resident",
    "resident_param_bytes",
    "resident_units",
    "resident_dtype",
    "first_step_all_gathers",
)


@dataclass
class Estimate:
    """The launch an estimate plans for (model, wrapper, mesh, dtypes, units) and its rows."""

    model: str
    wrapper: str
    num_processes: int
    shard_size: int
    replicate_size: int
    micro_batches: int
    mixed_precision: str
    reduce_dtype: str
    params: int
    units: list[dict] = field(default_factory=list)
    free_memory: int | None = None
    sharded_by: str = "accelerate"
    """Who wraps the model: "accelerate" (at prepare) or "transformers" (at load, `DistributedConfig`)."""
    compute_dtype: str = ""
    """The dtype forward and backward run in (the mixed-precision param dtype, else the model's)."""
    torch: str = ""
    """The torch series whose FSDP2 dtype rules the rows follow (`--torch`, else this process's)."""
    torch_running: str = ""
    """This process's `torch.__version__`: the FSDP that sharded the model (and simulated the step)."""
    modes: list[ModeEstimate] = field(default_factory=list)
    step_shape: dict | None = None
    """The forecast's inputs (micro-batch size, sequence length, optimizer, gradient
    checkpointing) when a step peak was asked for; None (and no step_peak keys) otherwise."""
    reference: ReferenceEstimate | None = None
    """GRPO's reference model with `--beta` > 0; None (and no `reference` key) without one."""
    keep_frozen_unsharded: str | None = None
    """The setting (auto, true, false) where the model has frozen units to keep (`--lora-r`);
    None (and no `keep_frozen_unsharded` key nor the rows' resident keys) otherwise."""
    use_vllm: bool = False
    """`--use-vllm`: vLLM generates (no generation phase) and no frozen unit is kept whatever
    `keep_frozen_unsharded` says."""

    def to_dict(self) -> dict:
        """Every field; without a step forecast the step_peak keys are left out, and without
        `--beta` the reference key and each row's reference keys, and without frozen units to keep
        the resident keys, and `use_vllm` unless set, so the JSON is what it was before any of them
        existed."""
        values = asdict(self)
        if not self.use_vllm:
            del values["use_vllm"]
        if self.keep_frozen_unsharded is None:
            del values["keep_frozen_unsharded"]
            for row in values["modes"]:
                for key in _RESIDENT_KEYS:
                    del row[key]
        if self.reference is None:
            del values["reference"]
            for row in values["modes"]:
                del row["reference_resident"], row["reference_all_gathers"]
        if self.step_shape is None:
            del values["step_shape"]
            for row in values["modes"]:
                for key in _STEP_PEAK_KEYS:
                    del row[key]
        return values

    def mode(self, name: str) -> ModeEstimate:
        return next(m for m in self.modes if m.mode == name)
