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
    fits: bool | None = None
    """max(peak_bytes, generation_bytes + held gradients) <= free memory x (1 - memory_margin); None
    without --grad-sync-free-memory."""
    selected: bool = False
    step_peak_bytes: int | None = None
    """The whole optimizer step's peak bytes per rank (step_peak.py); None where it was not asked
    for (--micro-batch-size/--seq-len) or could not be computed (`step_peak_unmodeled` says why)."""
    step_peak_phase: str = ""
    """Where the peak falls: first_micro_batch, later_micro_batch, optimizer_step or generation."""
    step_peak_parts: dict = field(default_factory=dict)
    """The peak's persistent parts and one micro-batch's activations, bytes per rank."""
    step_peak_unmodeled: list = field(default_factory=list)
    """Components the forecast could not compute: not in `step_peak_bytes`."""


_STEP_PEAK_KEYS = ("step_peak_bytes", "step_peak_phase", "step_peak_parts", "step_peak_unmodeled")


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
    modes: list[ModeEstimate] = field(default_factory=list)
    step_shape: dict | None = None
    """The forecast's inputs (micro-batch size, sequence length, optimizer, gradient
    checkpointing) when a step peak was asked for; None (and no step_peak keys) otherwise."""

    def to_dict(self) -> dict:
        """Every field; without a step forecast the step_peak keys are left out, so the JSON is
        what it was before the forecast existed."""
        values = asdict(self)
        if self.step_shape is None:
            del values["step_shape"]
            for row in values["modes"]:
                for key in _STEP_PEAK_KEYS:
                    del row[key]
        return values

    def mode(self, name: str) -> ModeEstimate:
        return next(m for m in self.modes if m.mode == name)
