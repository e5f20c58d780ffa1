"""Whether a model nothing trains (a reference model) stays unsharded for the whole run:
`decide_residency`, which binding and the estimate both call; and which frozen units of a trained
model `keep_frozen_unsharded` keeps (`frozen_units_to_keep`), by the same room.

A reference model never changes, yet FSDP2 all-gathers it at least once per optimizer step (for its
log-prob pass; resharded before training). Resident, it gathers once, at its first forward, then
never: what DDP pays, which replicates it. The price is its whole unsharded parameters (compute
dtype) on every rank for the whole run, beside the trained model's step. `keep_reference_unsharded`
true or false decides alone; auto lets the modes that plan within memory decide from those bytes:
`budget` keeps it where they fit its budget, `auto` where they fit free memory less the margin,
counted before the trained model's units (which are then planned within what is left: the
`reserved` bytes of `SyncPolicy.plan`). The other modes do not plan memory: auto leaves it off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accel_gradsync.config.settings import ResolvedConfig, SyncMode
from accel_gradsync.planning.costs import format_bytes
from accel_gradsync.planning.policies import budget_bytes
from accel_gradsync.planning.units import Unit

PLANNED_MODES = (SyncMode.BUDGET.value, SyncMode.AUTO.value)
"""The sync modes that decide residency from the bytes when the setting says auto."""


@dataclass(frozen=True)
class Residency:
    """A reference model's residency and the words that say why (its decision line's end)."""

    resident: bool
    reason: str


def room_for_residency(settings: ResolvedConfig, free_memory: Callable[[], int]) -> int:
    """What a planned mode lets a resident reference model take: budget's budget, auto's free
    memory (or `free_memory`) less the margin."""
    if settings.sync_mode == SyncMode.BUDGET:
        return budget_bytes(settings, free_memory)
    return int(free_memory() * (1 - settings.memory_margin))


def decide_residency(
    settings: ResolvedConfig, resident_bytes: int, free_memory: Callable[[], int], taken: int = 0
) -> Residency:
    """Whether a reference model whose unsharded params take `resident_bytes` per rank stays
    unsharded for the whole run. `taken`: what reference models bound before it keep resident
    already. `free_memory` is read only where a planned mode decides from it."""
    size = format_bytes(resident_bytes)
    if settings.keep_reference_unsharded is True:
        return Residency(True, f"keep_reference_unsharded=true: ~{size} unsharded params per rank for the run")
    if settings.keep_reference_unsharded is False:
        return Residency(False, "keep_reference_unsharded=false")
    if settings.sync_mode not in PLANNED_MODES:
        return Residency(
            False,
            f"sync mode {settings.sync_mode} does not plan memory; set keep_reference_unsharded=true to keep it "
            f"unsharded for the run (~{size} per rank, no all-gather after step 1)",
        )
    room = room_for_residency(settings, free_memory) - taken
    what = "budget" if settings.sync_mode == SyncMode.BUDGET else "free memory less the margin"
    fits = resident_bytes <= room
    return Residency(
        fits,
        f"its ~{size} unsharded params per rank {'fit' if fits else 'do not fit'} the {format_bytes(max(room, 0))} "
        f"of {settings.sync_mode}'s {what}" + (" left by other reference models" if taken else ""),
    )


def windows_every_unit(settings: ResolvedConfig) -> bool:
    """Deferral with every unit windowed (`keep_params_unsharded`): each unit's params are
    unsharded from the step's first forward to its optimizer step anyway."""
    return settings.sync_mode == SyncMode.DEFERRED and bool(settings.keep_params_unsharded)


def splits_frozen(settings: ResolvedConfig) -> bool:
    """Whether `keep_frozen_unsharded` gives a trained model's trainable modules FSDP2 units of
    their own at prepare (runtime/wrappers/frozen_units.py): true, or auto under a mode that plans
    memory or with every unit windowed (deferred with `keep_params_unsharded`)."""
    value = settings.keep_frozen_unsharded
    return value is True or (value is None and (settings.sync_mode in PLANNED_MODES or windows_every_unit(settings)))


def frozen_residency_under_vllm(settings: ResolvedConfig) -> ResolvedConfig:
    """`keep_frozen_unsharded` under TRL's `use_vllm`, for attach and the estimate alike: its weight
    sync merges the adapter into the sharded base between steps (`merge_adapter` adds DTensors),
    which a kept unit's plain tensors cannot take, and reads every weight whole each step anyway.
    true is refused; auto keeps nothing (the settings returned say false)."""
    if settings.keep_frozen_unsharded is True:
        raise ValueError(
            "keep_frozen_unsharded=true with use_vllm=true: TRL's weight sync merges the adapter into the "
            "sharded base between steps (merge_adapter), which a kept unsharded base cannot take; set "
            "keep_frozen_unsharded=false (auto keeps nothing under use_vllm)."
        )
    return dataclasses.replace(settings, keep_frozen_unsharded=False)


def frozen_units_to_keep(
    settings: ResolvedConfig, sizes: Sequence[int], free_memory: Callable[[], int], taken: int = 0
) -> list[bool]:
    """Which of a trained model's frozen units (their unsharded param bytes per rank, `sizes`, in
    model order) `keep_frozen_unsharded` keeps for the run: true all, false none; auto with every
    unit windowed all (its step holds every unit's params unsharded already: keeping the frozen ones adds
    nothing to its peak, only to the memory between steps), under a planned mode each in order
    while the bytes kept so far fit its room less `taken` (what resident reference models keep
    already), else none."""
    if settings.keep_frozen_unsharded is True or (splits_frozen(settings) and windows_every_unit(settings)):
        return [True] * len(sizes)
    if not splits_frozen(settings):
        return [False] * len(sizes)
    room, kept = room_for_residency(settings, free_memory) - taken, []
    for size in sizes:
        kept.append(size <= room)
        room -= size if kept[-1] else 0
    return kept


def kept_bytes(units: Sequence[Unit], keeps: bool, resident: bool) -> int:
    """Unsharded param bytes per rank a reference model of `units` keeps beyond what one of its
    forwards gathers anyway: resident, all of them for the whole run; kept through a pass
    (`keeps`), all but its largest unit; else 0. Budget and auto plan the trained models within
    memory less this (`SyncPolicy.plan`'s `reserved`), in a live run and in the estimate."""
    sizes = [u.param_bytes for u in units]
    if resident:
        return sum(sizes)
    if not keeps:
        return 0
    return sum(sizes) - max(sizes, default=0)
