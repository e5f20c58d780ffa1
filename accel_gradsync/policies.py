"""Sync policies: which FSDP units hold their gradient sync on a micro-batch that is not the last.

One subclass per mode, as torchtitan does for its activation-checkpointing modes. A policy
only decides, once per model and before the first step, producing a `Plan`; `fsdp.py`
applies it and `integration.py` calls both. The final micro-batch of every optimizer step
always syncs every unit, whatever the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .config import GradSyncConfig, parse_bytes
from .fsdp import ModelAdapter, Unit

GRADIENT_SYNC = "gradient_sync"  # skip reduce-scatter (and all-reduce): set_requires_gradient_sync(False)
ALL_REDUCE = "all_reduce"  # HSDP: reduce-scatter, skip the cross-replica all-reduce: set_requires_all_reduce(False)
NOTHING_TO_DEFER = "one micro-batch per optimizer step: nothing to defer"


@dataclass
class Plan:
    """What a policy decided for one model."""

    mode: str
    held: list[Unit] = field(default_factory=list)
    """Units whose sync is held on non-final micro-batches."""
    hold: str = GRADIENT_SYNC
    keep_params_unsharded: bool = False
    reason: str = ""

    def held_bytes(self) -> int:
        """Bytes per rank the held units keep between micro-batches (gradients, plus unsharded
        parameters when they are kept). For `all_reduce` holds only a sharded partial sum."""
        if self.hold == ALL_REDUCE:
            return sum(u.sharded_numel * u.held_dtype.itemsize for u in self.held)
        return sum(u.held_bytes + (u.param_bytes if self.keep_params_unsharded else 0) for u in self.held)

    def over(self, micro_batches: int) -> "Plan":
        """This plan as it plays out over `micro_batches` per optimizer step: with one, every
        micro-batch ends its step and syncs, so a deferring mode holds nothing."""
        if micro_batches > 1 or not self.held:
            return self
        return Plan(self.mode, reason=NOTHING_TO_DEFER)


def collectives_per_step(plan: Plan, units: Sequence[Unit], hsdp: bool, micro_batches: int) -> tuple[int, int]:
    """(reduce-scatters, HSDP all-reduces) per optimizer step: every unit syncs on each of the M
    micro-batches, a held unit skips M-1 of them, an all-reduce hold skips only all-reduces."""
    m = micro_batches
    per_sync = sum(u.collectives for u in units)
    held = sum(u.collectives for u in plan.held)
    if plan.hold == ALL_REDUCE:
        return per_sync * m, per_sync * m - held * (m - 1)
    issued = per_sync * m - held * (m - 1)
    return issued, issued if hsdp else 0


FreeMemory = Callable[[], int]
"""Free device bytes per rank, the minimum over ranks (measured once, on demand)."""


class SyncPolicy:
    """Base class: plan which units hold their sync for one wrapped model."""

    name: str = ""
    description: str = ""

    def __init__(self, config: GradSyncConfig) -> None:
        self.config = config

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        raise NotImplementedError

    def _require_fsdp2(self, adapter: ModelAdapter, why: str) -> None:
        if adapter.kind != "fsdp2":
            raise ValueError(
                f"GradSyncConfig.sync_mode={self.name!r} needs FSDP2 ({why}), but the model is wrapped in "
                f"{adapter.kind}. Use fsdp_version: 2 in the accelerate config, or sync_mode 'deferred' / "
                "'per_micro_batch'."
            )

    def _keep_params(self, adapter: ModelAdapter) -> bool:
        return self.config.keep_params_unsharded and adapter.kind == "fsdp2"


class PerMicroBatchSync(SyncPolicy):
    """Reduce-scatter every unit after every micro-batch: M x U collectives per optimizer step,
    gradients stay sharded. FSDP2: `requires_gradient_sync` stays True; FSDP1/DDP: no `no_sync()`."""

    name = "per_micro_batch"
    description = "reduce-scatter after every micro-batch (sharded grads, lowest memory)"

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        return Plan(self.name)


class DeferredSync(SyncPolicy):
    """Skip every unit's reduce-scatter until the last micro-batch: U collectives per step, but
    each rank holds the whole unsharded gradient between micro-batches. FSDP2:
    `set_requires_gradient_sync(False)`; FSDP1/DDP: root `no_sync()`."""

    name = "deferred"
    description = "reduce-scatter once per optimizer step (unsharded grads held)"

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        return Plan(self.name, list(adapter.units), keep_params_unsharded=self._keep_params(adapter))


class BudgetSync(SyncPolicy):
    """FSDP2 only: defer the set of units whose held bytes fit the budget, sync the rest every
    micro-batch (`set_requires_gradient_sync(False, recurse=False)` per unit).

    Every unit saves (M-1) reduce-scatters of its own bytes when deferred, so the most
    communication is saved by holding the most bytes that fit: first-fit decreasing by size."""

    name = "budget"
    description = "defer only the units whose unsharded grads fit a memory budget"

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        self._require_fsdp2(adapter, "per-unit requires_gradient_sync; FSDP1 has only the root's no_sync()")
        absolute, fraction = parse_bytes(self.config.memory_budget, "GradSyncConfig.memory_budget")
        budget = absolute if absolute is not None else int(fraction * free_memory())
        keep = self._keep_params(adapter)
        chosen, used = [], 0
        for unit in sorted(adapter.units, key=lambda u: u.held_bytes, reverse=True):
            cost = unit.held_bytes + (unit.param_bytes if keep else 0)
            if used + cost <= budget:
                chosen.append(unit)
                used += cost
        reason = f"{len(chosen)} of {len(adapter.units)} units fit the {format_bytes(budget)} budget ({format_bytes(used)} held)"
        return Plan(self.name, chosen, keep_params_unsharded=keep, reason=reason)


class DeferAllReduceSync(SyncPolicy):
    """HSDP (replicate x shard mesh) only: reduce-scatter every micro-batch, so gradients stay
    sharded, and skip only the all-reduce across replicas until the last one
    (`set_requires_all_reduce(False)`), as torchtitan does."""

    name = "defer_all_reduce"
    description = "HSDP: reduce-scatter every micro-batch, all-reduce across replicas once per step"

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        self._require_fsdp2(adapter, "set_requires_all_reduce")
        if not adapter.hsdp:
            raise ValueError(
                "GradSyncConfig.sync_mode='defer_all_reduce' needs an HSDP mesh with a replicate dimension, "
                "but the model is sharded over a 1-D mesh. Set parallelism_config dp_replicate_size > 1 "
                "in the accelerate config, or use sync_mode 'deferred'."
            )
        return Plan(self.name, list(adapter.units), hold=ALL_REDUCE)


class AutoSync(SyncPolicy):
    """Defer when the held bytes (plus the safety margin) fit the free device memory of every
    rank; else, on an HSDP mesh, defer only the all-reduce; else sync every micro-batch."""

    name = "auto"
    description = "deferred if it fits free memory, else defer_all_reduce (HSDP), else per_micro_batch"

    def plan(self, adapter: ModelAdapter, free_memory: FreeMemory) -> Plan:
        free = free_memory()
        usable = int(free * (1 - self.config.memory_margin))
        room = f"{format_bytes(usable)} usable of {format_bytes(free)} free (margin {self.config.memory_margin:g})"
        deferred = DeferredSync(self.config).plan(adapter, free_memory)
        if deferred.held_bytes() <= usable:
            choice, needs = deferred, deferred.held_bytes()
        elif adapter.hsdp and adapter.kind == "fsdp2":
            choice = DeferAllReduceSync(self.config).plan(adapter, free_memory)
            needs = choice.held_bytes()
            if needs > usable:
                choice = PerMicroBatchSync(self.config).plan(adapter, free_memory)
        else:
            choice, needs = PerMicroBatchSync(self.config).plan(adapter, free_memory), 0
        choice.reason = (
            f"auto chose {choice.mode}: full deferral holds {format_bytes(deferred.held_bytes())}/rank, {room}"
            + (f"; {choice.mode} holds {format_bytes(needs)}" if choice.mode == "defer_all_reduce" else "")
        )
        return choice


POLICIES: dict[str, type[SyncPolicy]] = {
    p.name: p for p in (PerMicroBatchSync, DeferredSync, BudgetSync, DeferAllReduceSync, AutoSync)
}


def resolve_policy(config: GradSyncConfig) -> SyncPolicy:
    """The policy a config selects."""
    try:
        return POLICIES[config.mode](config)
    except KeyError:
        raise ValueError(
            f"GradSyncConfig selects sync mode {config.mode!r}; valid choices: {', '.join(POLICIES)}."
        ) from None


def format_bytes(n: int) -> str:
    """Bytes for a message: exact below 1 KiB, else KiB, MiB or GiB with one decimal."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
