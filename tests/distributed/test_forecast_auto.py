"""`auto` planning step 1 from the whole-step forecast (planning/replan.py, estimator/forecast/live.py), on
real gloo ranks, FSDP2, a tiny Qwen2 built from its transformers config: counted from outside,
step 1 already reduce-scatters once per unit (no measuring step), every rank runs the same plan,
the decision line shows the forecast, and `stats()` carries it beside the measured peak, the peak `accel-gradsync
estimate` gives the same plan (one number: the forecaster simulates the chosen plan as the estimate
does). A device whose step comes more than the margin over the forecast (a scripted probe: CPU
memory is resident growth, which auto does not compare with a forecast) re-plans once, from the
measurement. A scheduler's SIGTERM to every process during the forecast (the same launch, its last
run) leaves the forecast to finish and is held like any other: saved at step 1's end, exit 75."""

import json

import pytest
from common import tiny_qwen2_config
from launcher import WORKERS, launch

from accel_gradsync import PREEMPTED_EXIT_CODE, GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.inputs import StepShape
from accel_gradsync.planning.costs import format_bytes
from testbed.launch import launch as launch_ranks

M, STEPS = 4, 3
SHAPE = {"sync_mode": "auto", "forecast_micro_batch_size": 2, "forecast_seq_len": 16, "free_memory": "40GiB"}
CONFIG = {  # the layer class to wrap is the model's own (_no_split_modules), as in the recipe's config
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
}
OVER = 2**30  # a step peak far above any forecast of this model, far below the scripted capacity


def _launch(run: dict) -> list[dict]:
    return launch("forecast_auto", ["--runs", json.dumps([run]), "--M", str(M), "--steps", str(STEPS)], CONFIG)


PREEMPTED = {"name": "preempted", "config": {**SHAPE, "save_on_signal": "SIGTERM"}, "preempt_in_forecast": True}


@pytest.fixture(scope="module")
def launched():
    """One launch: the forecast run, then the run preempted during its forecast (exits 75)."""
    args = ["--runs", json.dumps([{"name": "forecast", "config": SHAPE}, PREEMPTED]), "--M", str(M)]
    return launch_ranks(WORKERS / "forecast_auto.py", [*args, "--steps", str(STEPS)], CONFIG, nprocs=2, timeout=600)


@pytest.fixture(scope="module")
def ranks(launched):
    assert len(launched.ranks) == 2, launched.output[-12000:]
    return launched.ranks


@pytest.fixture(scope="module")
def overshoot():
    return _launch({"name": "overshoot", "config": SHAPE, "probe": {"capacity": 40 * 2**30, "peaks": [OVER]}})


def test_step_one_runs_the_forecast_plan_with_no_measuring_step(ranks):
    for rank in ranks:
        run = rank["runs"]["forecast"]
        units = run["units"]
        assert run["first_plan_held"] == units  # the whole tiny model fits 40 GiB: every unit held
        assert [s["reduce_scatters"] for s in run["steps"]] == [units] * STEPS  # step 1 included
        assert all(s["plan_changes"] == 0 for s in run["steps"])  # CPU: not compared, no re-plan
        assert all(s["forecast_peak_bytes"] > 0 for s in run["steps"])
        # auto reads a step's peak at the next window's start: step 1's is there after step 2.
        assert [s["measured_peak_bytes"] is not None for s in run["steps"]] == [False, True, True]
    assert [s["held"] for s in ranks[0]["runs"]["forecast"]["steps"]] == [
        s["held"] for s in ranks[1]["runs"]["forecast"]["steps"]
    ]
    printed = ranks[0]["runs"]["forecast"]["printed"]
    assert "auto planned step 1 from the forecast: peak" in printed and "2x16 tokens per micro-batch" in printed
    assert ranks[1]["runs"]["forecast"]["printed"] == ""  # the main process prints


def test_the_forecast_peak_is_what_the_estimate_gives_that_plan(ranks, tmp_path):
    """`accel-gradsync estimate` for the same model, launch, M, free memory and micro-batch shape:
    its auto row plans the same units and its step peak is the number the live run forecast."""
    tiny_qwen2_config().save_pretrained(tmp_path)
    config = GradSyncConfig(sync_mode="auto", free_memory=SHAPE["free_memory"])
    est = estimate(str(tmp_path), CONFIG, M, config, step_shape=StepShape(2, 16))
    row = next(m for m in est.modes if m.mode.split(" ")[0] == "auto")  # "auto -> <what it planned>"
    run = ranks[0]["runs"]["forecast"]
    assert row.units_held == run["first_plan_held"] == run["units"]
    assert {s["forecast_peak_bytes"] for r in ranks for s in r["runs"]["forecast"]["steps"]} == {row.step_peak_bytes}
    assert f"step peak {format_bytes(row.step_peak_bytes)}/rank forecast" in run["printed"]


def test_a_preemption_during_the_forecast_is_held_until_step_one_ends(launched):
    """The child ignores the scheduler's SIGTERM (the forecast finishes, step 1 runs its plan); the
    rank that got it saves with every other at the first step boundary and each exits 75."""
    output = launched.output
    assert output.count(f"exitcode  : {PREEMPTED_EXIT_CODE} ") == 2, output[-6000:]
    assert "exitcode  : -15" not in output, output[-6000:]
    runs = [rank["runs"]["preempted"] for rank in launched.ranks]
    assert runs[0]["child_running"] is True  # the signal came while the forecast ran
    assert [r["preempted_at_step"] for r in runs] == [1, 1], runs
    assert all(r["forecast_peak_bytes"] for r in runs), runs
    assert "auto planned step 1 from the forecast" in runs[0]["printed"], runs[0]["printed"]
    assert "forecast failed" not in runs[0]["printed"]


@pytest.mark.slow  # the re-plan on a scripted device is also unit-tested (tests/unit/planning/test_replan.py)
def test_a_step_over_the_forecast_re_plans_once_from_what_was_measured(overshoot):
    ranks = overshoot
    for rank in ranks:
        run = rank["runs"]["overshoot"]
        units = run["units"]
        assert [s["reduce_scatters"] for s in run["steps"]] == [units] * STEPS
        assert [s["plan_changes"] for s in run["steps"]] == [0, 1, 1]  # read at step 2's start, once
        first, later = run["steps"][0], run["steps"][1]
        assert first["forecast_peak_bytes"] < OVER and later["forecast_peak_bytes"] is None
        assert later["measured_peak_bytes"] == OVER
    assert "grad sync: auto re-plans: step 1 peak 1.0 GiB/rank" in ranks[0]["runs"]["overshoot"]["printed"]
