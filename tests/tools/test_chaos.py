"""tools/chaos.py's pieces that decide a verdict, checked fast: the plan gives each launch as
many restarts as it has kills and ends a launch at each preemption, and the checkpoint comparison
sees a one-bit difference in an optimizer state. The chaos run itself (real launches, real
faults) is tests/distributed/test_recipe_chaos.py, with --slow."""

from __future__ import annotations

import random

import torch

from tools.chaos import WHERE, compare_checkpoints, draw_faults, plan_attempts, unplanned_restarts


def test_each_kill_is_a_restart_of_its_launch_and_each_preemption_ends_one():
    actions = ["kill", "kill", "preempt", "kill", "preempt"]
    faults = [{"id": i, "action": a} for i, a in enumerate(actions)]
    plan, restarts = plan_attempts(faults)
    assert list(plan) == ["0-0", "0-1", "0-2", "1-0", "1-1"]
    assert restarts == [2, 1, 0]  # the last launch, after the last preemption, runs undisturbed


def test_faults_are_drawn_from_the_seed_and_none_strikes_after_a_restart_that_did_not_happen():
    faults = draw_faults(random.Random(3), 40, "SIGUSR1")
    assert faults == draw_faults(random.Random(3), 40, "SIGUSR1")
    assert faults[0]["where"] != "restart"
    assert {f["where"] for f in faults} == set(WHERE) and {f["action"] for f in faults} == {"kill", "preempt"}
    assert all(1 <= f["n"] <= WHERE[f["where"]] for f in faults)


def test_the_comparison_sees_one_bit_of_an_optimizer_state(tmp_path):
    state = {"state": {0: {"exp_avg": torch.randn(5), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        torch.save(state, tmp_path / name / "optimizer.bin")
        (tmp_path / name / "trainer_state.json").write_text(name)  # not training state: not compared
    assert compare_checkpoints(tmp_path / "a", tmp_path / "b") == []
    flipped = state["state"][0]["exp_avg"].clone()
    flipped.view(torch.int32)[2] ^= 1
    state["state"][0]["exp_avg"] = flipped
    torch.save(state, tmp_path / "c" / "optimizer.bin")
    assert compare_checkpoints(tmp_path / "a", tmp_path / "c") == ["optimizer.bin/state/0/exp_avg"]
    assert compare_checkpoints(tmp_path / "a", tmp_path / "missing") != []


def test_a_restart_no_kill_caused_is_reported(tmp_path):
    """A rank failing by itself is restarted by the launch like a killed one: the run must not count as survived."""
    (tmp_path / "attempts").mkdir()
    for attempt in ("0-0", "0-1", "1-0", "1-1"):
        (tmp_path / "attempts" / f"{attempt}.json").write_text('{"start": 0}')
    fired = [{"attempt": "0-0", "action": "kill"}, {"attempt": "1-0", "action": "preempt"}]
    assert unplanned_restarts(tmp_path, fired) == ["restart 1-1 without a kill (see log.txt)"]
