"""`auto` on real gloo ranks, FSDP2: it syncs every micro-batch in step 1 while it
measures, then follows the plan that fits, falls back when one rank's peak grows past the
margin (both ranks agree), and moves back up after quiet steps; the device is played by a
scripted memory probe (capacity 10 kB, the 10% margin leaves 9 kB), the collectives are real
and counted from outside, and every step's gradients equal the single-process reference."""

import json

import pytest
from launcher import accelerate_config, launch
from workers.common import TinyNet

from accel_gradsync.planning.replan import QUIET_STEPS

M = 4
WINDOWS = QUIET_STEPS + 4  # step 1, two steps windowed, the step that grows, the quiet steps, the move up
CAPACITY = 10_000
# TinyNet, fp32: each Block holds 1088 B of gradient and 1088 B of params when windowed, the
# root's head 68 + 68: 4488 B with every unit windowed.
QUIET = 6_000
PEAKS = {
    0: [4_000, 8_488, 8_488] + [QUIET] * (WINDOWS - 3),
    1: [4_000, 8_488, 9_500] + [QUIET] * (WINDOWS - 3),  # rank 1 grows past 9 kB in step 3
}


@pytest.fixture(scope="module")
def ranks():
    runs = [
        {
            "name": "auto",
            "config": {"sync_mode": "auto", "memory_margin": 0.1},
            "probe": {"capacity": CAPACITY, "peaks_by_rank": [PEAKS[0], PEAKS[1]]},
        }
    ]
    args = ["--M", str(M), "--batches", str(M * WINDOWS), "--runs", json.dumps(runs)]
    return launch("accumulate", args, accelerate_config("fsdp2"))


def _levels(step):
    lv = step["levels"]
    return lv["units_windowed"], lv["units_deferred"], lv["units_per_micro_batch"]


def test_step_one_syncs_every_micro_batch_and_later_steps_follow_the_plan(ranks):
    for rank in ranks:
        steps = rank["modes"]["auto"]["steps"]
        assert len(steps) == WINDOWS
        reduce_scatters = [s["counts"]["reduce_scatter_single"] for s in steps]
        assert reduce_scatters == [M * TinyNet.UNITS] + [TinyNet.UNITS] * (WINDOWS - 1)
        assert _levels(steps[0]) == (0, 0, 3)
        assert _levels(steps[1]) == _levels(steps[2]) == (3, 0, 0)  # 4488 B fit the 5000 B left
        assert all(s["max_diff"] <= 1e-5 for s in steps)


def test_a_growing_peak_on_one_rank_falls_back_on_both_and_quiet_steps_move_it_back_up(ranks):
    plans = []
    for rank in ranks:
        steps = rank["modes"]["auto"]["steps"]
        # Step 3's peak (rank 1) was 500 B over: the next window demotes the largest unit, one Block.
        fallen = range(3, WINDOWS - 1)
        assert all(_levels(steps[k]) == (2, 1, 0) for k in fallen), [_levels(s) for s in steps]
        gathers = [s["counts"].get("all_gather_single", 0) for s in steps]
        assert all(gathers[k] == 1 + 2 * M + 1 for k in fallen)  # the deferred Block gathers in each pass again
        # After QUIET_STEPS quiet steps the plan moves back up, not sooner.
        assert _levels(steps[-1]) == (3, 0, 0)
        assert rank["modes"]["auto"]["stats"]["plan_changes"] == 2
        assert rank["modes"]["auto"]["stats"]["measured_peaks"][-1] == QUIET
        plans.append([_levels(s) for s in steps])
    assert plans[0] == plans[1]  # the ranks agree at every step
