"""Live counters of what the sync policy did. Pure bookkeeping: no torch.distributed, no device
reads, so recording a micro-batch costs a few integer additions in the hot path.

Counts are per *unit sync*: one FSDP unit's reduce-scatter (one per param group), or for DDP
one whole-model all-reduce pass (which DDP splits into buckets of its own choosing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from .fsdp import Unit


@dataclass
class StepCounts:
    """What one accumulation window (one optimizer step) did."""

    micro_batches: int = 0
    deferred_micro_batches: int = 0
    reduce_scatters_issued: int = 0
    reduce_scatters_skipped: int = 0
    all_reduces_issued: int = 0
    all_reduces_skipped: int = 0

    def add(self, other: "StepCounts") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class SyncAccounting:
    """Totals since `attach`, plus the window in progress and the last finished one."""

    mode: str
    wrapper: str = "none"
    collective: str = "reduce_scatter"
    units: int = 0
    optimizer_steps: int = 0
    total: StepCounts = field(default_factory=StepCounts)
    current: StepCounts = field(default_factory=StepCounts)
    last_step: StepCounts = field(default_factory=StepCounts)

    def record_micro_batch(self, synced: Sequence[Unit], held: Sequence[Unit], ends_step: bool) -> None:
        """Count one micro-batch whose backward syncs `synced` and holds `held`."""
        step = StepCounts(micro_batches=1, deferred_micro_batches=int(bool(held)))
        issued = sum(u.collectives for u in synced)
        skipped = sum(u.collectives for u in held)
        if self.collective == "all_reduce":
            step.all_reduces_issued, step.all_reduces_skipped = issued, skipped
        else:
            step.reduce_scatters_issued, step.reduce_scatters_skipped = issued, skipped
        self.current.add(step)
        self.total.add(step)
        if ends_step:
            self.optimizer_steps += 1
            self.last_step, self.current = self.current, StepCounts()

    def stats(self) -> dict:
        """Flat dict: totals since attach, and the last finished step under `last_step/`."""
        out = {
            "mode": self.mode,
            "wrapper": self.wrapper,
            "units": self.units,
            "optimizer_steps": self.optimizer_steps,
            **asdict(self.total),
        }
        out.update({f"last_step/{k}": v for k, v in asdict(self.last_step).items()})
        return out
