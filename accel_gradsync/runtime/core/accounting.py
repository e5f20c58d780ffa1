"""Live counters of what the sync policy did. Pure bookkeeping: no torch.distributed, no device
reads, so recording a micro-batch costs a few integer additions in the hot path.

Counts are per *unit sync*: one FSDP unit's reduce-scatter (one per param group), or for DDP
one whole-model all-reduce pass (which DDP splits into buckets of its own choosing).

A micro-batch is what `accumulate()`, the Trainer's `no_sync` or an optimizer step delimits
(window.py), however many forwards with gradients it runs.

FSDP2's all-gathers and reductions are counted as FSDP issues them, from its state at that
moment (fsdp2_counts.py): a reshard the plan does not know of (a `state_dict()`, an evaluation)
and a model forwarded twice per micro-batch count as they ran. FSDP1's and DDP's are counted per
micro-batch, one sync per unit that does not hold, and FSDP1's all-gathers from each unit's flags
and whether its params are unsharded when the micro-batch starts (a forward without gradients
leaves FSDP1's root gathered), with the function (`costs.micro_batch_all_gathers`) the decision
line and the estimate count with. Training all-gathers and those of forwards without gradients
(generation, evaluation) are counted apart. Every FSDP unit counts, frozen ones included; a frozen unit reduces nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field, fields

from accel_gradsync.planning.costs import micro_batch_all_gathers
from accel_gradsync.planning.units import Level, Unit


@dataclass
class StepCounts:
    """What one accumulation window (one optimizer step) did."""

    micro_batches: int = 0
    deferred_micro_batches: int = 0
    reduce_scatters_issued: int = 0
    reduce_scatters_skipped: int = 0
    all_reduces_issued: int = 0
    all_reduces_skipped: int = 0
    bytes_reduced: int = 0
    """Unsharded gradient bytes handed to the issued reduce-scatters (DDP: all-reduces)."""
    all_gathers: int = 0
    """Parameter all-gathers of the training micro-batches (forward and backward), over every unit."""
    generation_all_gathers: int = 0
    """Parameter all-gathers of forwards without gradients (generation, log-prob passes, evaluation)."""
    replicated_all_reduces: int = 0
    """All-reduces transformers' Trainer issues itself, one per trainable parameter outside the
    FSDP2 units (an adapter added after load-time sharding) at the window's last backward."""
    replayed_micro_batches: int = 0
    """Inside `grad_sync.step(n)` (uneven_steps.py): micro-batches this rank replayed x 0 up to the
    step's largest count (counted in `micro_batches` too)."""
    evened_micro_batches: int = 0
    """Inside `grad_sync.step(n)`: micro-batches this rank ran below the step's largest count and
    did not replay, a plan whose collectives do not depend on the count making them free."""
    held_grad_bytes: int = 0
    """Unsharded gradient bytes the wrapper held after the last deferred micro-batch, measured
    before the window's last forward."""
    fewest_micro_batches: int = 0
    """Inside `grad_sync.step(n)`: the step's smallest count over ranks (0 outside)."""
    most_micro_batches: int = 0
    """Inside `grad_sync.step(n)`: the step's largest count over ranks (0 outside)."""

    def add(self, other: StepCounts) -> None:
        # Runs on every micro-batch: plain getattr, not asdict (which deep-copies).
        for name in _FLOWS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_LEVELS = ("held_grad_bytes", "fewest_micro_batches", "most_micro_batches")  # per step, not flows
_FLOWS = tuple(f.name for f in fields(StepCounts) if f.name not in _LEVELS)


@dataclass
class SyncAccounting:
    """Totals since `attach`, plus the window in progress and the last finished one. It counts
    what ran; the plan (each unit's level) and `auto`'s measurements belong to their owners and
    are handed to `stats()`."""

    mode_selected: str = ""
    """The mode GradSyncConfig selects."""
    wrapper: str = "none"
    collective: str = "reduce_scatter"
    hsdp: bool = False
    units: int = 0
    optimizer_steps: int = 0
    aborted_steps: int = 0
    peak_held_grad_bytes: int = 0
    total: StepCounts = field(default_factory=StepCounts)
    current: StepCounts = field(default_factory=StepCounts)
    last_step: StepCounts = field(default_factory=StepCounts)
    step_ending: bool = False
    """The last micro-batch recorded ended an optimizer step and may still be running: what it
    gathers goes to `last_step` until `close_step()` (the optimizer step, else the next micro-batch)."""

    def record_micro_batch(
        self,
        units: Sequence[Unit],
        held: Sequence[Unit],
        hold: str,
        ends_step: bool,
        windowed: Sequence[Unit] = (),
        keeps_params_when_held: bool = False,
        gathered: Set[int] = frozenset(),
    ) -> None:
        """Count one micro-batch over `units` whose backward holds the sync of `held`: all of
        it (`gradient_sync`), or on HSDP only the cross-replica `all_reduce`: one unit sync
        skipped per held unit. What it issues: FSDP2's as it runs (fsdp2_counts.py), else one
        sync per unit that does not hold, and FSDP1's all-gathers from its flags and `gathered`,
        the `id` of each unit whose params are unsharded as the micro-batch starts
        (`_planned_all_gathers`)."""
        self.step_ending = False
        step = StepCounts(micro_batches=1, deferred_micro_batches=int(bool(held)))
        held_ids = {id(u) for u in held}
        if self.wrapper == "fsdp1":
            step.all_gathers = self._planned_all_gathers(
                units, held_ids, ends_step, windowed, keeps_params_when_held, gathered
            )
        live = self.wrapper == "fsdp2"
        for unit in units:
            n, holds = unit.collectives, id(unit) in held_ids
            if self.collective == "all_reduce":  # DDP: one bucketed all-reduce pass per sync
                step.all_reduces_skipped += n if holds else 0
                step.all_reduces_issued += 0 if holds else n
                step.bytes_reduced += 0 if holds else unit.reduce_bytes
                continue
            if holds:  # the whole sync, or under HSDP with `hold` "all_reduce" its all-reduce
                step.reduce_scatters_skipped += n if hold != "all_reduce" else 0
                step.all_reduces_skipped += n if self.hsdp else 0
            if live or (holds and hold != "all_reduce"):
                continue
            step.reduce_scatters_issued += n
            step.bytes_reduced += unit.reduce_bytes
            step.all_reduces_issued += n if self.hsdp and not holds else 0
        self.current.add(step)
        self.total.add(step)
        if ends_step:
            self.optimizer_steps += 1
            self.last_step, self.current = self.current, StepCounts()
            self.step_ending = True

    def _planned_all_gathers(
        self,
        units: Sequence[Unit],
        held_ids: set[int],
        ends_step: bool,
        windowed: Sequence[Unit],
        keeps_params_when_held: bool,
        gathered: Set[int],
    ) -> int:
        """FSDP1's all-gathers of one micro-batch from each unit's flags: the plan's `windowed`
        units keep their params through it (held ones also after its backward); SHARD_GRAD_OP
        keeps every held unit's params after backward (`keeps_params_when_held`)."""
        window_ids = {id(u) for u in windowed}
        total = 0
        for unit in units:
            key = id(unit)
            kept = key in window_ids and (key in held_ids or ends_step)
            after = key in held_ids and (key in window_ids or keeps_params_when_held)
            total += micro_batch_all_gathers(unit, key in gathered, kept, after)[0]
        return total

    def end_step(self) -> None:
        """An optimizer step ran, for a model no micro-batch is recorded on (a frozen one): what it
        gathered since the step before is the last step's."""
        self.optimizer_steps += 1
        self.last_step, self.current = self.current, StepCounts()

    def close_step(self) -> None:
        """The optimizer step ran: the last micro-batch's backward is over."""
        self.step_ending = False

    def record_reduction(self, reduce_scatters: int, all_reduces: int, grad_bytes: int) -> None:
        """What one FSDP2 post-backward is about to reduce (fsdp2_counts.py)."""
        window = self.last_step if self.step_ending else self.current
        for counts in (window, self.total):
            counts.reduce_scatters_issued += reduce_scatters
            counts.all_reduces_issued += all_reduces
            counts.bytes_reduced += grad_bytes

    def record_all_gathers(self, gathers: int, training: bool) -> None:
        """`gathers` all-gathers FSDP2 is about to issue: for a forward with gradients or a backward
        (`training`), else for a forward without (generation, evaluation)."""
        window = self.last_step if self.step_ending else self.current
        for counts in (window, self.total):
            if training:
                counts.all_gathers += gathers
            else:
                counts.generation_all_gathers += gathers

    def record_replicated_all_reduce(self) -> None:
        """transformers' Trainer all-reduces one replicated parameter's gradient, in the backward
        of the micro-batch that ended the step (already counted into `last_step`)."""
        for counts in (self.last_step, self.total):
            counts.replicated_all_reduces += 1

    def abort_step(self) -> None:
        """An exception ended the accumulation: its micro-batches stay in the totals, the next
        window starts from zero."""
        self.aborted_steps += 1
        self.current, self.step_ending = StepCounts(), False

    def record_uneven(self, fewest: int, most: int) -> None:
        """A `grad_sync.step(n)` block starts the window (uneven_steps.py): the step's smallest and
        largest count over ranks."""
        self.current.fewest_micro_batches, self.current.most_micro_batches = fewest, most

    def record_skipped(self, replayed: int, evened: int) -> None:
        """Inside `grad_sync.step(n)`, as they happen: a replay about to run (counted in
        `micro_batches` too as it runs), or at this rank's last micro-batch the ones a free plan
        evens out."""
        for counts in (self.current, self.total):
            counts.replayed_micro_batches += replayed
            counts.evened_micro_batches += evened

    def record_held(self, held_grad_bytes: int) -> None:
        """The bytes measured after the window's held micro-batches, before its last forward."""
        self.current.held_grad_bytes = held_grad_bytes
        self.peak_held_grad_bytes = max(self.peak_held_grad_bytes, held_grad_bytes)

    def stats(
        self,
        mode: str,
        unit_modes: Mapping[str, str],
        plan_changes: int = 0,
        measured_peaks: Sequence[int] = (),
        forecast_peak: int | None = None,
    ) -> dict:
        """Flat dict: totals since attach, and the last finished step under `last_step/`; with
        the plan's `mode` and each unit's level (`unit_modes`, by module name, "" the root) and
        `auto`'s `plan_changes`, `measured_peaks` and the current plan's `forecast_peak`, which
        their owners keep."""
        out = {
            "mode": mode,
            "mode_selected": self.mode_selected,
            "wrapper": self.wrapper,
            "hsdp": self.hsdp,
            "units": self.units,
            "unit_modes": dict(unit_modes),
            "optimizer_steps": self.optimizer_steps,
            "aborted_steps": self.aborted_steps,
            "peak_held_grad_bytes": self.peak_held_grad_bytes,
            "plan_changes": plan_changes,
            **{f"units_{level}": list(unit_modes.values()).count(level) for level in Level},
            "measured_peaks": list(measured_peaks),
            **({"measured_peak_bytes": measured_peaks[-1]} if measured_peaks else {}),
            **({"forecast_peak_bytes": forecast_peak} if forecast_peak is not None else {}),
            **asdict(self.total),
        }
        for level in _LEVELS:  # per step only: see last_step/
            del out[level]
        out.update({f"last_step/{k}": v for k, v in asdict(self.last_step).items()})
        return out


# How each counter of one model's stats() combines over several bound models. Every model sees
# every micro-batch of a window, so window counts are each model's (the largest, should one
# model skip a forward); what the models issue and hold is theirs, added up.
_PER_PROCESS = ("measured_peak_bytes", "forecast_peak_bytes")
"""Peaks of the whole process, kept as the first model reports them, not added up."""
_ONCE_PER_WINDOW = (
    "optimizer_steps",
    "aborted_steps",
    "micro_batches",
    "deferred_micro_batches",
    "replayed_micro_batches",
    "evened_micro_batches",
    "fewest_micro_batches",
    "most_micro_batches",
)


def combined_stats(per_model: dict[str, dict], mode_selected: str) -> dict:
    """The stats() of a run with one or more bound models: window counts once, collectives,
    bytes, held bytes and units added up, and each model's own under `models`."""
    if not per_model:  # nothing bound yet: every counter at zero
        return {**SyncAccounting(mode_selected=mode_selected).stats(mode_selected, {}), "models": {}}
    stats = list(per_model.values())
    out = dict(stats[0])
    for key, value in stats[0].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key in _PER_PROCESS:
            continue
        values = [s.get(key, 0) for s in stats]
        out[key] = max(values) if key.removeprefix("last_step/") in _ONCE_PER_WINDOW else sum(values)
    if len(stats) > 1:
        out["mode"] = "+".join(dict.fromkeys(s["mode"] for s in stats))
        out["unit_modes"] = {
            f"{name}/{unit}": mode for name, s in per_model.items() for unit, mode in s["unit_modes"].items()
        }
    out["models"] = per_model
    return out
