"""`auto` planning step 1 from the whole-step forecast (planning/replan.py, estimator/live.py), on
real gloo ranks, FSDP2, a tiny Qwen2 built from its transformers config: counted from outside,
step 1 already reduce-scatters once per unit (no measuring step), every rank runs the same plan,
the decision line shows the forecast, and `stats()` carries it beside the measured peak. A device
whose step comes more than the margin over the forecast (a scripted probe: CPU memory is resident
growth, which auto does not compare with a forecast) re-plans once, from the measurement."""

import json

import pytest
from launcher import launch

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


@pytest.fixture(scope="module")
def ranks():
    return _launch({"name": "forecast", "config": SHAPE})


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
