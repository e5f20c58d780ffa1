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
    fits: bool | None = None
    """max(peak_bytes, generation_bytes + held gradients) <= free memory x (1 - memory_margin); None
    without --grad-sync-free-memory."""
    selected: bool = False


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

    def to_dict(self) -> dict:
        return asdict(self)

    def mode(self, name: str) -> ModeEstimate:
        return next(m for m in self.modes if m.mode == name)
