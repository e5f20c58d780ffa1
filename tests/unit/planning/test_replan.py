"""`auto` from measured memory, played on a scripted device (no GPU): step 1 per
micro-batch, the plan after it, a fall-back when peaks grow, a recovery after quiet steps and
never a change back and forth from one step to the next. Units are the GRPO recipe model's,
found on the meta device by the estimate's adapter (FSDP2, fp32: 3 units)."""

import re

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.planning.costs import format_bytes
from accel_gradsync.planning.memory import ScriptedMemoryProbe
from accel_gradsync.planning.replan import QUIET_STEPS, Forecast, MeasuredAuto

M = 4
FSDP2 = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
}
CONFIG = GradSyncConfig(sync_mode="auto", memory_margin=0.1)
CAPACITY = 10 * 2**20  # a 10 MiB "device": limit 9 MiB with the 10% margin


def scripted(base, simulated=None):
    """A forecast of `base` bytes for a step that holds nothing, whose simulation of a plan gives
    `simulated(plan)` (default: `base` plus what the plan holds)."""
    simulated = simulated or (lambda plan: base + plan.held_bytes())
    return Forecast(base, "scripted", simulate=lambda plan: Forecast(simulated(plan), "simulated"))


@pytest.fixture(scope="module")
def adapter():
    model = build_meta_model(load_model_config("recipe-default"))
    return estimated_adapter(model, read_accelerate_config(FSDP2), CONFIG)


def play(adapter, peaks, other_rank_peaks=None, messages=None, forecast=None, probe=None):
    """Run the planner over a scripted series of step peaks; return the plan of every step (and
    append each change's line, the one the main process prints, to `messages`)."""
    probe = ScriptedMemoryProbe(CAPACITY, peaks) if probe is None else probe
    others = iter(other_rank_peaks or [])

    def agree(peak, capacity):  # a second rank, scripted too: the largest peak decides
        return max(peak, next(others, 0)), capacity

    auto = MeasuredAuto(CONFIG, probe, agree)
    plan = auto.first_plan() if forecast is None else auto.first_plan(adapter, M, forecast)
    plans = [plan]
    for _ in peaks[1:]:
        change = auto.at_window_start(adapter, plan, M)
        plan = change.plan if change else plan
        plans.append(plan)
        if change and messages is not None:
            messages.append(change.message)
    return plans, auto


def levels(plan, adapter):
    return [plan.level(u) for u in adapter.units]


def test_step_one_syncs_every_micro_batch_then_the_plan_fits_what_is_left(adapter):
    full = sum(u.held_bytes + u.param_bytes for u in adapter.units)  # every unit windowed
    plans, auto = play(adapter, [2 * 2**20, 2 * 2**20 + full])
    assert not plans[0].held and "step 1" in plans[0].reason
    assert levels(plans[1], adapter) == ["windowed"] * len(adapter.units)  # 7 MiB of room: all fits
    assert list(auto.peaks) == [2 * 2**20]
    # Little room after step 1: only what fits is held.
    plans, _ = play(adapter, [9 * 2**20 - 200 * 2**10, 0])
    assert 0 < plans[1].held_bytes() <= 200 * 2**10


def test_a_growing_peak_falls_back_one_level_largest_units_first_and_recovers_after_quiet_steps(adapter):
    base, full = 2 * 2**20, sum(u.held_bytes + u.param_bytes for u in adapter.units)
    grown = 9 * 2**20 + 10 * 2**10  # 10 KiB over the limit
    peaks = [base, base + full, grown] + [base + full - 300 * 2**10] * (QUIET_STEPS + 2)
    plans, auto = play(adapter, peaks)
    largest = max(adapter.units, key=lambda u: u.numel)
    after = plans[3]  # the window after the step that grew
    assert after.level(largest) == "deferred" and after.held_bytes() < plans[2].held_bytes()
    assert all(after.level(u) == "windowed" for u in adapter.units if u is not largest)  # one unit was enough
    # No change back and forth: the plan holds until QUIET_STEPS quiet steps, then moves up.
    assert all(p is after for p in plans[3 : 3 + QUIET_STEPS])
    assert levels(plans[3 + QUIET_STEPS], adapter) == ["windowed"] * len(adapter.units)
    assert auto.changes == 2


def test_the_rank_with_the_higher_peak_decides(adapter):
    base = 2 * 2**20
    full = sum(u.held_bytes + u.param_bytes for u in adapter.units)
    # This rank stays quiet; the other one grows past the limit in step 3.
    plans, _ = play(adapter, [base, base + full, base + full], other_rank_peaks=[0, 9 * 2**20 + 2**20])
    assert plans[2].held_bytes() < plans[1].held_bytes()


def test_a_peak_past_capacity_in_step_one_holds_nothing(adapter):
    plans, _ = play(adapter, [CAPACITY, CAPACITY])
    assert not plans[1].held and plans[1].mode == "per_micro_batch"


def test_each_plan_change_is_one_plain_line_with_the_peak_it_read(adapter):
    base, full = 2 * 2**20, sum(u.held_bytes + u.param_bytes for u in adapter.units)
    grown, quiet = 9 * 2**20 + 10 * 2**10, base + full - 300 * 2**10
    peaks = [base, base + full, grown] + [quiet] * (QUIET_STEPS + 2)
    messages = []
    play(adapter, peaks, messages=messages)

    def room(peak):
        return f"peak {format_bytes(peak)}/rank of {format_bytes(CAPACITY)} (margin 0.1)"

    assert messages == [
        f"grad sync: auto measured step 1: {room(base)}; from step 2 on:",
        f"grad sync: auto falls back one level: step {room(grown)}; now:",
        f"grad sync: auto moves back up after {QUIET_STEPS} quiet steps ({room(quiet)}):",
    ]
    for message in messages:
        assert not re.search(r"\b(\w+) \1\b", message), message  # no word said twice in a row


def test_a_forecast_plans_step_one_as_a_measured_step_one_of_that_peak_would(adapter):
    base = 2 * 2**20
    measured, _ = play(adapter, [base, base])
    forecast, auto = play(adapter, [base + measured[1].held_bytes()], forecast=scripted(base))
    assert forecast[0].held == measured[1].held and forecast[0].windowed == measured[1].windowed
    assert forecast[0].held and "from the forecast" in forecast[0].reason
    assert auto.forecast_of(forecast[0]) == base + forecast[0].held_bytes()  # what `scripted` simulates
    # No forecast peak (a model it cannot build): step 1 measures, and the line says why.
    plans, _ = play(adapter, [base, base], forecast=Forecast(None, "no forecast: a PEFT model"))
    assert not plans[0].held and "(no forecast: a PEFT model)" in plans[0].reason and plans[1].held


def test_a_step_more_than_the_margin_over_the_forecast_re_plans_from_the_measurement(adapter):
    base = 2 * 2**20
    first = play(adapter, [base], forecast=scripted(base))[0][0]
    expected = base + first.held_bytes()
    # Within the margin (10%) of the forecast: the plan stays, nothing changes.
    plans, auto = play(adapter, [int(expected * 1.09)] * 3, forecast=scripted(base))
    assert all(p is plans[0] for p in plans) and auto.changes == 0 and auto.forecast_of(plans[0]) == expected
    # Far over it: re-planned from what was measured, which leaves less room, and auto then
    # plans from measurements (no forecast any more).
    overshoot = 9 * 2**20 + 200 * 2**10  # 200 KiB over the limit once what the plan holds is freed
    messages = []
    plans, auto = play(adapter, [overshoot, overshoot], forecast=scripted(base), messages=messages)
    assert plans[1].held_bytes() < plans[0].held_bytes() and auto.changes == 1
    assert auto.forecast_of(plans[1]) is None and auto.forecast_of(plans[0]) is None
    assert (
        messages[0].startswith(f"grad sync: auto re-plans: step 1 peak {format_bytes(overshoot)}/rank")
        and "forecast" in messages[0]
    )
    # A restored run goes on planning from the forecast it saved.
    again = MeasuredAuto(CONFIG, ScriptedMemoryProbe(CAPACITY, [base]), lambda p, c: (p, c))
    planned, saved = play(adapter, [base], forecast=scripted(base))
    again.restore(saved.record())
    assert again.forecast_of(planned[0]) == expected


def test_the_forecast_of_the_plan_is_the_forecasters_simulation_of_it(adapter):
    """The plan's peak is what the forecaster simulates for that plan (the estimate's row), not the
    step that holds nothing plus the plan's held bytes: the line, stats() and the overshoot check
    read that one number. A plan the forecaster cannot simulate is not run from the forecast."""
    base = 2 * 2**20
    simulated = {}

    def simulate(plan):  # held gradients and activations need not peak together: less than base + held
        simulated[len(simulated)] = plan
        return base + plan.held_bytes() // 2 + 4096

    plans, auto = play(adapter, [base] * 2, forecast=scripted(base, simulate))
    assert [levels(p, adapter) for p in simulated.values()] == [levels(plans[0], adapter)]  # step 1's, once
    peak = base + plans[0].held_bytes() // 2 + 4096
    assert plans[0].held and auto.forecast_of(plans[0]) == peak
    assert f"step peak {format_bytes(peak)}/rank forecast" in plans[0].reason
    # Within the margin of the simulated peak, though above base + held/2: no re-plan.
    plans, auto = play(adapter, [int(peak * 1.09)] * 3, forecast=scripted(base, simulate))
    assert auto.changes == 0
    plans, auto = play(adapter, [int(peak * 1.11)] * 2, forecast=scripted(base, simulate))
    assert auto.changes == 1 and auto.forecast_of(plans[1]) is None
    # The forecaster could not simulate the plan: step 1 measures, and says why.
    failing = Forecast(base, "scripted", simulate=lambda plan: Forecast(None, "the simulation failed: X"))
    plans, _ = play(adapter, [base, base], forecast=failing)
    assert not plans[0].held and "the simulation failed: X" in plans[0].reason and plans[1].held


class _ResidentGrowth(ScriptedMemoryProbe):
    counts_tensor_bytes = False  # as the CPU probe: resident-memory growth, not tensor bytes


def test_a_probe_that_counts_no_tensor_bytes_is_not_compared_with_the_forecast(adapter):
    base = 2 * 2**20
    plans, auto = play(
        adapter, [8 * 2**20] * 3, forecast=scripted(base), probe=_ResidentGrowth(CAPACITY, [8 * 2**20] * 3)
    )
    assert all(p is plans[0] for p in plans) and auto.changes == 0
    assert "CPU: the measured peak is not compared with it" in plans[0].reason


def test_a_forecast_plan_leaves_room_for_what_reference_models_keep(adapter):
    """The forecast does not see a reference model kept per unit (`reserved`): the plan from it fits
    what is left after those bytes, and its line says so."""
    base = 2 * 2**20
    full = sum(u.held_bytes + u.param_bytes for u in adapter.units)
    limit = int(CAPACITY * (1 - CONFIG.memory_margin))
    reserved = limit - base - full // 2  # room for half of what every unit windowed holds

    def first(reserved):
        auto = MeasuredAuto(CONFIG, ScriptedMemoryProbe(CAPACITY, [base]), lambda p, c: (p, c))
        return auto.first_plan(adapter, M, scripted(base), reserved)

    alone, shared = first(0), first(reserved)
    assert alone.held_bytes() == full  # everything fits without the reference model
    assert 0 < shared.held_bytes() <= limit - base - reserved < alone.held_bytes()
    assert f"{format_bytes(reserved)} kept by reference models" in shared.reason
    assert "reference" not in alone.reason
