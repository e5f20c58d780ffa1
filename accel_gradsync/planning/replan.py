"""`auto` from measured memory: measure step 1, then plan; fall back when peaks grow, move back
up after quiet steps.

Free memory read before the first step overstates what a step leaves: Adam allocates its states
at the first `step()`, activations exist only inside a step, GRPO's completions grow over
training. So `auto` runs the first optimizer step per micro-batch while the probe measures its
peak on every rank, and from the second step on uses the most communication-saving plan
(`policies.plan_within`: windowed, deferred, per micro-batch per unit; on HSDP also all-reduce
deferral) whose held bytes fit `capacity x (1 - margin) - peak`, the poorest rank deciding.

Every later window start reads the last step's peak (one number per step, kept in `peaks`).
When it came within the margin of capacity, the next window falls back one level, largest
units first (windowed to deferred, deferred to per micro-batch) until the overshoot is freed.
After `QUIET_STEPS` steps in a row with room, it moves back up to what fits with half the
margin to spare: it never changes plan from one step to the next both ways. Plans change only
between windows.

Given a `Forecaster` (attach passes the estimator's when the forecast shape is set), step 1 does
not measure: the forecast peak of a step that syncs every micro-batch stands in for step 1's
measured one, so step 1 already runs the plan. The forecaster then simulates that plan (the
estimate's row for it: one number, `forecast_of`), and each step's measured peak under it is
compared with that; one more than the margin above it re-plans from the measurement, and from
then on `auto` plans from measurements only. A plan the forecaster cannot simulate is not run
from the forecast: step 1 measures.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from accel_gradsync.config.settings import ResolvedConfig, SyncMode
from accel_gradsync.planning.costs import format_bytes, generation_bytes_of
from accel_gradsync.planning.memory import MemoryProbe
from accel_gradsync.planning.policies import kept_elsewhere, mode_of, plan_within
from accel_gradsync.planning.units import ALL_REDUCE, Level, Plan, Wrapped

QUIET_STEPS = 10
"""Steps in a row with room before a plan moves back up."""
KEPT_PEAKS = 32

Agree = Callable[[int, int], tuple[int, int]]
"""(this rank's peak, capacity) -> (the largest peak, the smallest capacity) over all ranks."""


@dataclass(frozen=True)
class Forecast:
    """The forecast peak per rank of an optimizer step that syncs every micro-batch and holds
    nothing (`peak_bytes`; None: no forecast), and one line on how it was made or why not."""

    peak_bytes: int | None
    note: str
    simulate: Callable[[Plan], Forecast] | None = field(default=None, compare=False, repr=False)
    """The step peak of a plan, simulated as the estimate simulates its row for that plan (None:
    this forecast cannot). A collective where the forecaster answers on one rank: every rank calls
    it with the same plan."""


class Forecaster(Protocol):
    """Forecasts a bound model's step peak from its config (estimator/forecast/live.py). Every rank calls
    it at bind and gets the same answer."""

    def forecast(self, model: Any, micro_batches: int, kept: Sequence[str] = ()) -> Forecast:
        """`kept`: the names of the units `keep_frozen_unsharded` keeps for the run (`Unit.resident`)."""
        ...


@dataclass
class Change:
    """A plan decided at a window start, and the one line that says why (main process prints it)."""

    plan: Plan
    message: str


@dataclass
class MeasuredAuto:
    """The state of one model's measured `auto` plan."""

    config: ResolvedConfig
    probe: MemoryProbe
    agree: Agree
    peaks: deque = field(default_factory=lambda: deque(maxlen=KEPT_PEAKS))
    """The agreed peak of each of the last steps, bytes per rank."""
    measured_steps: int = 0
    quiet: int = 0
    changes: int = 0
    """Plan changes after the first plan (fall-backs, recoveries, a re-plan off the forecast)."""
    forecast_peak: int | None = None
    """The simulated peak of the plan step 1 ran from the forecast, while `auto` trusts the
    forecast (None: planning from measurements)."""
    forecast_levels: list | None = None
    """That plan's units by level (`_levels_of`): `forecast_of` answers for that plan only."""

    def first_plan(
        self,
        adapter: Wrapped | None = None,
        micro_batches: int = 1,
        forecast: Forecast | None = None,
        reserved: int = 0,
    ) -> Plan:
        """Step 1's plan: from `forecast` where it has a peak, else sync every micro-batch while
        the probe measures the step's peak (generation's gathered params included, `adapter` given).
        `reserved`: what reference models keep (`SyncPolicy.plan`), which the forecast does not
        see; a measured peak holds it already."""
        self.probe.reset_peak()
        generation = 0 if adapter is None else generation_bytes_of(adapter, self.config)
        if adapter is None or forecast is None or forecast.peak_bytes is None:
            why = "" if forecast is None else f" ({forecast.note})"
            return Plan(
                SyncMode.AUTO,
                reason=f"step 1 syncs every micro-batch and measures its peak memory{why}",
                generation_bytes=generation,
            )
        _, capacity = self.agree(0, self.probe.capacity())
        limit = int(capacity * (1 - self.config.memory_margin))
        chosen = plan_within(adapter, limit - forecast.peak_bytes - reserved, micro_batches, generation)
        simulated = forecast.simulate(chosen) if forecast.simulate is not None else None
        if simulated is None or simulated.peak_bytes is None:
            why = "no simulation of a plan" if simulated is None else simulated.note
            return Plan(
                SyncMode.AUTO,
                reason=f"step 1 syncs every micro-batch and measures its peak memory ({forecast.note}; {why})",
                generation_bytes=generation,
            )
        self.forecast_peak, self.forecast_levels = simulated.peak_bytes, _levels_of(chosen)
        return replace(
            chosen,
            reason=(
                f"auto planned step 1 from the forecast: peak {format_bytes(forecast.peak_bytes)}/rank syncing "
                f"every micro-batch ({forecast.note}), {format_bytes(capacity)} free (margin "
                f"{self.config.memory_margin:g})"
                + (f", {kept_elsewhere(reserved, adapter)}" if reserved else "")
                + f"; holds {format_bytes(chosen.held_bytes())}, step peak "
                f"{format_bytes(simulated.peak_bytes)}/rank forecast"
                + ("" if self.probe.counts_tensor_bytes else "; CPU: the measured peak is not compared with it")
            ),
        )

    def forecast_of(self, plan: Plan) -> int | None:
        """The forecast peak of a step under `plan`: the simulated one where `plan` is the plan
        step 1 ran from the forecast (None for another plan, and once `auto` plans from
        measurements)."""
        if self.forecast_peak is None or _levels_of(plan) != self.forecast_levels:
            return None
        return self.forecast_peak

    def record(self) -> dict:
        """What a checkpoint keeps of this planner (`restore` takes it back)."""
        return {
            "peaks": list(self.peaks),
            # The main process's: a checkpoint may be saved without the other ranks (DDP), so no
            # collective agrees it; the resumed run's first reading agrees it with theirs.
            "unread_peak": self.probe.peak(),
            "measured_steps": self.measured_steps,
            "quiet": self.quiet,
            "changes": self.changes,
            "forecast_peak": self.forecast_peak,
            "forecast_levels": self.forecast_levels,
        }

    def restore(self, record: dict) -> None:
        """Go on from a checkpoint's `record()`: the peak measured since its last reading counts
        into this run's first one."""
        self.peaks.clear()
        self.peaks.extend(record["peaks"])
        self.measured_steps, self.quiet, self.changes = record["measured_steps"], record["quiet"], record["changes"]
        self.forecast_peak, self.forecast_levels = record.get("forecast_peak"), record.get("forecast_levels")
        self.probe = CarriedPeak(self.probe, record["unread_peak"])

    def at_window_start(self, adapter: Wrapped, plan: Plan, micro_batches: int) -> Change | None:
        """Read the step that just ended; return the next window's plan when it changes."""
        peak, capacity = self.agree(self.probe.peak(), self.probe.capacity())
        self.probe.reset_peak()
        self.peaks.append(peak)
        self.measured_steps += 1
        limit = int(capacity * (1 - self.config.memory_margin))
        room = f"peak {format_bytes(peak)}/rank of {format_bytes(capacity)} (margin {self.config.memory_margin:g})"
        forecast = self.forecast_of(plan)
        if (
            forecast is not None
            and self.probe.counts_tensor_bytes
            and peak > forecast * (1 + self.config.memory_margin)
        ):
            # The forecast missed something this run holds: plan from what was measured, as
            # after a measured step 1, and stop trusting the forecast.
            self.forecast_peak = self.forecast_levels = None
            self.changes += 1
            chosen = plan_within(adapter, limit - max(peak - plan.held_bytes(), 0), micro_batches)
            chosen = replace(
                chosen,
                generation_bytes=plan.generation_bytes,
                reason=f"auto re-planned from step {self.measured_steps}: {room}, forecast {format_bytes(forecast)}",
            )
            return Change(
                chosen,
                f"grad sync: auto re-plans: step {self.measured_steps} {room} came more than the margin over the "
                f"forecast {format_bytes(forecast)}; now:",
            )
        if self.measured_steps == 1 and self.forecast_peak is None:
            # The measured peak already holds what generation gathered (gather_for_generation):
            # generation ran in step 1, so it is not taken off a second time.
            chosen = plan_within(adapter, limit - peak, micro_batches)
            chosen = replace(
                chosen,
                generation_bytes=generation_bytes_of(adapter, self.config),
                reason=f"auto measured step 1: {room}; holds {format_bytes(chosen.held_bytes())}",
            )
            return Change(chosen, f"grad sync: auto measured step 1: {room}; from step 2 on:")
        if peak > limit and plan.held:
            self.quiet = 0
            lower = fall_back(plan, adapter, peak - limit)
            if lower is None:
                return None
            self.changes += 1
            lower = replace(lower, reason=f"auto fell back: {room}, {format_bytes(peak - limit)} over")
            return Change(lower, f"grad sync: auto falls back one level: step {room}; now:")
        self.quiet += 1
        if self.quiet < QUIET_STEPS:
            return None
        self.quiet = 0
        # What the step needs besides what this plan holds, and room for a better plan with half
        # the margin to spare, so a plan that only just fits is not taken.
        needs = max(peak - plan.held_bytes(), 0)
        spare = int(capacity * self.config.memory_margin / 2)
        higher = replace(
            plan_within(adapter, limit - needs - spare, micro_batches), generation_bytes=plan.generation_bytes
        )
        if _saves_more(higher, plan, adapter):
            self.changes += 1
            higher = replace(higher, reason=f"auto moved up after {QUIET_STEPS} quiet steps: {room}")
            return Change(higher, f"grad sync: auto moves back up after {QUIET_STEPS} quiet steps ({room}):")
        return None


def _levels_of(plan: Plan) -> list:
    """`plan`'s units by name per level, as a checkpoint keeps it: two plans with equal lists run
    the same step."""
    return [[u.name for u in plan.held], [u.name for u in plan.windowed], plan.held_sync, plan.generation_bytes]


def fall_back(plan: Plan, adapter: Wrapped, overshoot: int) -> Plan | None:
    """`plan` with units one level lower, largest first, until `overshoot` bytes are freed (or
    every unit went one level down); None when nothing can go lower."""
    if plan.held_sync == ALL_REDUCE:
        return Plan(SyncMode.PER_MICRO_BATCH, generation_bytes=plan.generation_bytes)  # the only level below
    held, windowed = list(plan.held), list(plan.windowed)
    freed = 0
    for unit in sorted(adapter.units, key=lambda u: u.param_numel, reverse=True):
        if freed >= overshoot:
            break
        if any(u is unit for u in windowed):
            windowed = [u for u in windowed if u is not unit]
            freed += unit.param_bytes
        elif any(u is unit for u in held):
            held = [u for u in held if u is not unit]
            freed += unit.held_bytes
    if freed == 0:
        return None
    mode = mode_of(Plan("", held, windowed=windowed), adapter.units)
    return Plan(mode, held, windowed=windowed, generation_bytes=plan.generation_bytes)


def _saves_more(a: Plan, b: Plan, adapter: Wrapped) -> bool:
    """True when plan `a` puts units at higher levels than `b` overall."""
    return _score(a, adapter) > _score(b, adapter)


def _score(plan: Plan, adapter: Wrapped) -> float:
    levels = {
        Level.FROZEN: 0.0,
        Level.PER_MICRO_BATCH: 0.0,
        Level.DEFER_ALL_REDUCE: 0.5,
        Level.DEFERRED: 1.0,
        Level.WINDOWED: 2.0,
    }
    return sum(levels[plan.level(u)] * u.param_numel for u in adapter.units)


class CarriedPeak(MemoryProbe):
    """A resumed run's probe until its first reading: the peak the saving run had measured since
    its last reading (the step that ended before a boundary checkpoint, the first micro-batches of
    a window) counts, as it did in the uninterrupted run; then `probe` alone."""

    def __init__(self, probe: MemoryProbe, carried: int) -> None:
        self.probe, self.carried = probe, carried
        self.counts_tensor_bytes = probe.counts_tensor_bytes

    def capacity(self) -> int:
        return self.probe.capacity()

    def reset_peak(self) -> None:
        self.carried = 0
        self.probe.reset_peak()

    def peak(self) -> int:
        return max(self.carried, self.probe.peak())
