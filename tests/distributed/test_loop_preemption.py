"""`save_on_signal` in a loop of its own (workers/preemption_loop.py, FSDP2 deferred, 2 gloo ranks
under `accelerate launch`, no restarts): SIGTERM to rank 1 alone in the middle of step 2's window
makes both ranks learn it at the end of step 2 (`grad_sync.preempted()`), save there with
`accelerator.save_state` and exit with `PREEMPTED_EXIT_CODE`, which torch elastic's agent reports
for each rank; a launch that loads that checkpoint ends with parameters and optimizer state equal,
bit for bit, to an uninterrupted run's (`--slow`). SIGTERM to rank 1 after the loop's last ask,
with no `detach()`, while it does AFTER_S seconds of after-training work, is not swallowed: it takes
its own action at the deadline (`preemption.DEADLINE_FLOOR_S` here, the loop's asks being quick).
"""

from __future__ import annotations

import pytest
from launcher import WORKERS, accelerate_config

from accel_gradsync import PREEMPTED_EXIT_CODE
from accel_gradsync.runtime.faults.preemption import DEADLINE_FLOOR_S
from testbed.launch import launch

M = 3  # micro-batches per optimizer step (the worker's)
SIGNAL_AT = 4  # 0-based: the second micro-batch of step 2
STEP = (SIGNAL_AT // M) + 1  # the step in progress when the signal comes: every rank saves at its end
AFTER_S = 30 * DEADLINE_FLOOR_S  # rank 1's after-training work: the signal must end it first, however slow the loop was


def _launch(phase: str, tmp, *extra: str):
    """workers/preemption_loop.py's `phase` on 2 ranks, FSDP2, its files under `tmp`."""
    args = ["--phase", phase, "--checkpoint", str(tmp / "checkpoint"), "--reference", str(tmp), *extra]
    return launch(WORKERS / "preemption_loop.py", args, accelerate_config("fsdp2"), timeout=600)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preemption_loop")
    return _launch("preempt", tmp, "--signal-at", str(SIGNAL_AT)), tmp


def test_sigterm_to_one_rank_saves_every_rank_at_that_step_and_each_exits_with_the_code(preempted):
    done, tmp = preempted
    output = done.output
    assert done.returncode != 0, output[-6000:]
    assert [r["step"] for r in done.ranks] == [STEP, STEP], output[-6000:]  # both told at the same step
    line = f"accel_gradsync: SIGTERM: saved {tmp / 'checkpoint'}; exiting with code {PREEMPTED_EXIT_CODE}"
    assert output.count(line) == 1, output[-6000:]  # printed by the main process
    assert (tmp / "checkpoint" / "micro_batches.json").is_file()
    # torch elastic's report, one entry per rank: each rank exited with the code, none died of a
    # SIGTERM the agent sent to close the ranks still running after the first exit.
    assert output.count(f"exitcode  : {PREEMPTED_EXIT_CODE} ") == 2, output[-6000:]
    assert "exitcode  : -15" not in output, output[-6000:]


# A second launch; the default suite resumes FSDP2 deferral from a step boundary's save_state in
# test_resume.py and test_reliability_edge.py, this case only adds who chose the step.
@pytest.mark.slow
def test_resuming_from_that_checkpoint_ends_as_if_uninterrupted(preempted):
    done = _launch("resume", preempted[1])
    assert done.returncode == 0, done.output[-6000:]
    assert len(done.ranks) == 2
    for rank in done.ranks:
        assert rank["tensors"] > 0 and rank["differs"] == [], rank


def test_sigterm_after_the_last_ask_without_detach_takes_its_own_action_at_the_deadline(tmp_path):
    done = _launch("after-loop", tmp_path, "--after-s", str(AFTER_S))
    output = done.output
    # Rank 1 died of its SIGTERM (torch elastic reports -15) inside its after-training work.
    assert done.returncode != 0 and "exitcode  : -15" in output, output[-6000:]
    assert "rank 1: after-training work done" not in output, output[-6000:]
    assert not (tmp_path / "checkpoint").exists()  # no agreement point: nothing saved
