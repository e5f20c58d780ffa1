"""`save_on_signal` in a loop of its own, one process on CPU: `grad_sync.preempted()` answers False
inside an accumulation window and True at the end of the optimizer step the signal came in;
`exit_preempted()` prints the line and exits with `PREEMPTED_EXIT_CODE`; a loop that never asks
gets one warning and the signal back with its own action (a signal that came before is passed on).
The multi-rank runs (agreement, `save_state`, resuming bit for bit, each rank's exit code) are in
tests/distributed/test_loop_preemption.py."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.optim.optimizer import register_optimizer_step_post_hook

import accel_gradsync
from accel_gradsync import PREEMPTED_EXIT_CODE, GradSyncConfig, GradSyncWarning

M, STEPS = 2, 4


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCEL_GRADSYNC_SAVE_ON_SIGNAL"):
        monkeypatch.delenv(var, raising=False)
    previous = signal.getsignal(signal.SIGUSR1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    signal.signal(signal.SIGUSR1, previous)


def attached(save_on_signal: str = "SIGUSR1"):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=M)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "accel_gradsync: single process")
        grad_sync = accel_gradsync.attach(accelerator, GradSyncConfig(save_on_signal=save_on_signal))
    return accelerator, model, optimizer, grad_sync


def micro_batch(accelerator, model, optimizer) -> None:
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()


def test_the_loop_is_told_at_the_end_of_the_step_the_signal_came_in_and_exits_with_the_code(capsys):
    accelerator, model, optimizer, grad_sync = attached()
    answers = []
    with pytest.raises(SystemExit) as exited:
        for k in range(M * STEPS):
            if k == M + 0:  # before the first micro-batch of step 2
                os.kill(os.getpid(), signal.SIGUSR1)
            micro_batch(accelerator, model, optimizer)
            answers.append(grad_sync.preempted())
            if answers[-1]:
                grad_sync.exit_preempted("ckpt/step-2")
    assert exited.value.code == PREEMPTED_EXIT_CODE
    # Step 1 ends untold, the signal's micro-batch is mid-window, step 2's end tells.
    assert answers == [False, False, False, True]
    assert (
        f"accel_gradsync: SIGUSR1: saved ckpt/step-2; exiting with code {PREEMPTED_EXIT_CODE}"
        in capsys.readouterr().out
    )


MOMENTS = ("before_micro_batch", "after_backward", "after_optimizer_step", "after_asking")


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("k", range(M * STEPS))
def test_a_signal_at_any_moment_is_acted_on_once(k, moment):
    """The signal at each moment of each micro-batch k: the loop is told at the end of the
    optimizer step it came in, or of the next one where that step had already asked (its last
    micro-batch, after asking), and never twice. After the last ask there is no step left to
    save at: detach gives the signal its own action back and raises it again, once."""
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))  # the loop's own handler
    accelerator, model, optimizer, grad_sync = attached()
    answers = []
    for i in range(M * STEPS):
        if (i, moment) == (k, "before_micro_batch"):
            os.kill(os.getpid(), signal.SIGUSR1)
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 4)).sum())
            if (i, moment) == (k, "after_backward"):
                os.kill(os.getpid(), signal.SIGUSR1)
            optimizer.step()
            if (i, moment) == (k, "after_optimizer_step"):
                os.kill(os.getpid(), signal.SIGUSR1)
            optimizer.zero_grad()
        answers.append(grad_sync.preempted())
        if (i, moment) == (k, "after_asking"):
            os.kill(os.getpid(), signal.SIGUSR1)
        if answers[-1]:
            break
    step = k // M + (moment == "after_asking" and (k + 1) % M == 0)  # 0-based step told
    grad_sync.detach()
    if step < STEPS:
        assert answers == [False] * (M * step + M - 1) + [True], answers
        assert got == []  # acted on: the loop saves and exits (exit_preempted), no second action
    else:
        assert answers == [False] * (M * STEPS), answers
        assert got == [signal.SIGUSR1]  # not lost: the loop's own handler gets it at detach


def test_a_loop_that_never_asks_gets_one_warning_and_the_signal_keeps_its_own_action():
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))  # the loop's own handler
    accelerator, model, optimizer, grad_sync = attached()
    # A global post-step hook after ours, as a multi-rank run registers the window's at bind: torch
    # iterates over them while ours runs, so ours must not remove itself then.
    other = register_optimizer_step_post_hook(lambda *args: None)
    assert signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL and not got  # counted by the plugin from attach on
    os.kill(os.getpid(), signal.SIGUSR1)
    assert not got
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(M * STEPS):
            micro_batch(accelerator, model, optimizer)
    ours = [w for w in caught if issubclass(w.category, GradSyncWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    for name in ("save_on_signal", "Trainer", "grad_sync.preempted()", "exit_preempted"):
        assert name in message, message
    assert got == [signal.SIGUSR1]  # the signal that came meanwhile reached the loop's own handler
    os.kill(os.getpid(), signal.SIGUSR1)
    assert got == [signal.SIGUSR1, signal.SIGUSR1]  # and every later one
    grad_sync.detach()
    other.remove()


def test_none_answers_false_without_a_handler_and_detach_gives_the_handler_back():
    before = signal.getsignal(signal.SIGUSR1)
    accelerator, model, optimizer, grad_sync = attached("none")
    assert signal.getsignal(signal.SIGUSR1) == before
    micro_batch(accelerator, model, optimizer)
    micro_batch(accelerator, model, optimizer)
    assert grad_sync.preempted() is False
    grad_sync.detach()
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, model, optimizer, grad_sync = attached()
    assert signal.getsignal(signal.SIGUSR1) != before
    grad_sync.detach()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_exit_before_the_ranks_agreed_is_refused():
    _, _, _, grad_sync = attached()
    with pytest.raises(ValueError, match=r"exit_preempted\(\).*preempted\(\)"):
        grad_sync.exit_preempted()
    grad_sync.detach()
