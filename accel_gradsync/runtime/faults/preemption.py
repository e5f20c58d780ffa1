"""Save on the scheduler's warning signal, then exit with `PREEMPTED_EXIT_CODE`: `Preemption` (the
signal flag and the ranks' agreement), which the Trainer callback `callback.SaveOnSignal`
(`GradSyncConfig.save_on_signal`) and a training loop of its own (`GradSyncHandle.preempted()` /
`exit_preempted()`) use.

The handler only counts the signal: no collective, I/O or lock inside a handler, so a signal during
generation, a save or a collective changes nothing there. The ranks agree at the end of every
optimizer step and after every checkpoint save (a MAX over the ranks' flags, one small collective
on the plugin's own group, agreement.py); when one rank got the signal, all save at that step, then
exit. Under torch elastic with `--max_restarts`, the main process of each node first tells its
agent (SIGTERM), so that the agent shuts down instead of spending a restart on the exit
(docs/recipe.md, Preemption). From the exit on, the signals are ignored: the agent closes the ranks
still running with SIGTERM once one has exited, and a rank already finalizing (Python's handlers
gone) would otherwise report -15 instead of 75.

A loop of its own must ask; one that never does is found at the second step of an optimizer
(`watch_loop`): one warning, and the signal gets its own action back (one that came meanwhile is
raised again), so that setting it changes nothing for such a loop. A signal after the last
agreement has no step left to save at. A Trainer's last step: it is raised again when the handler
is given back at train end. A loop's last `preempted()`: the loop may go on with a final
evaluation, save or upload and never ask again, so the loop's asks set a deadline (`_Deadline`):
a signal not agreed on within three times the longest interval between two asks so far (at
least `DEADLINE_FLOOR_S`) takes its own action then; detach does the same at once. Never dropped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.runtime.core.agreement import ControlGroup

PREEMPTED_EXIT_CODE = 75
"""The exit code of a process that saved on the signal and stopped (EX_TEMPFAIL: try again later)."""
NO_SIGNAL = "none"
# How long each rank waits for its agent to take the stop (its SIGTERM back): the agent forwards
# within milliseconds; the deadline only keeps a rank whose agent is gone from waiting for nothing.
_AGENT_ACK_S = 10.0
DEADLINE_FLOOR_S = 10.0
"""The least time a loop of its own gets, after its last ask or the signal, to ask again before a
signal nobody agreed on takes its own action (`_Deadline`)."""
_DEADLINE_FACTOR = 3  # times the longest interval between two asks seen


class Preemption:
    """The flag one signal sets in this process, and the ranks' agreement on it."""

    def __init__(self, signal_name: str, control: ControlGroup) -> None:
        self.signum = signal.Signals[signal_name]
        self.control = control
        self.received = 0
        self.agreed = False
        self._deadline: _Deadline | None = None  # a loop of its own: `watch_loop`
        self._expired = False  # the deadline passed: the next signal takes its own action
        self._previous: dict[int, Any] = {}
        self._stepped: weakref.WeakSet = weakref.WeakSet()  # optimizers seen stepping (watch_loop)
        self._watch: Any = None  # the optimizer post-step hook of `watch_loop`
        self._watch_over = False  # `watch_loop` warned: its hook does nothing more
        self._passed_on = False  # a signal not acted on was raised again for its own handler

    def install(self) -> None:
        """Count the signal from now on, instead of its own action (main thread only)."""
        self._catch(self.signum)

    def restore(self) -> None:
        """The signals' own handlers back, and no more watching of the loop (detach, the end of a
        Trainer's training without the signal agreed on)."""
        self._unwatch()
        if self._deadline is not None:
            self._deadline.stop()
            self._deadline = None
        self._restore_signals()

    def _restore_signals(self) -> None:
        """The handlers from before back; a signal counted since and never acted on (after the
        ranks' last agreement, or in a loop that never asks) is raised again, once, so that it
        does what it would have done without the plugin."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self.received and not self.agreed and not self._passed_on:
            self._passed_on = True
            signal.raise_signal(self.signum)

    def _catch(self, signum: int) -> None:
        previous = signal.signal(signum, self._count)  # also over a handler another library put back meanwhile
        self._previous.setdefault(signum, previous)

    def _count(self, signum: int, frame: Any) -> None:
        self.received += 1  # the whole handler (see the module docstring), but after the deadline:
        if self._expired:
            self._restore_signals()  # its own action, now (raised again)

    def agree(self) -> bool:
        """True, on every rank alike, once any rank has received the signal. A collective: every
        rank calls it at the same point; once True it stays True without another one."""
        if not self.agreed:
            self.agreed = bool(self.control.max([1 if self.received else 0])[0])
        return self.agreed

    def ask(self, accelerator: Any, inside_join: bool = False) -> bool:
        """A loop of its own: `agree` at the end of an optimizer step (False without a collective
        inside an accumulation window, where `accelerator.sync_gradients` is False on every rank,
        and inside `join()`, where a rank that left would never ask). Each ask moves the deadline."""
        self._unwatch()  # it asks
        if self._deadline is not None:
            self._deadline.asked()
        return accelerator.sync_gradients and not inside_join and self.agree()

    def watch_loop(self) -> None:
        """Warn once, at the second step of an optimizer, when the loop has not asked by then; and
        from the first ask on, give a signal nobody agreed on its own action once the loop stops
        asking (`_Deadline`)."""
        self._watch = register_optimizer_step_post_hook(self._check_asked)
        self._deadline = _Deadline(self)

    def expire(self) -> None:
        """The deadline passed with a signal counted and not agreed on: send it again, so that the
        handler, in the main thread, gives it its own action (called from the deadline's thread)."""
        self._expired = True
        os.kill(os.getpid(), self.signum)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _check_asked(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # NOTE: the hook stays registered until `ask`, `restore` or detach: torch is iterating over
        # its post-step hooks right now, and removing one here raises in `optimizer.step()`.
        if self._watch_over:
            return
        if optimizer not in self._stepped:
            self._stepped.add(optimizer)
            return
        self._watch_over = True
        if self._deadline is not None:
            self._deadline.stop()  # no ask will come
            self._deadline = None
        name = self.signum.name
        warnings.warn(
            f"accel_gradsync: save_on_signal={name!r} is set, but this loop never asked grad_sync.preempted(), so "
            f"nothing would be saved: {name} keeps its own action. A Trainer asks by itself; a loop of its own "
            f"asks after every micro-batch: `if grad_sync.preempted(): accelerator.save_state(dir); "
            f"grad_sync.exit_preempted(dir)` (docs/modes.md, Preemption).",
            GradSyncWarning,
            stacklevel=2,
        )
        self._restore_signals()  # a signal that came meanwhile does what it would have done

    def exit(self, accelerator: Any) -> None:
        """After the checkpoint: leave the agent out of restarting, then exit with `PREEMPTED_EXIT_CODE`."""
        if self._deadline is not None:
            self._deadline.stop()
            self._deadline = None
        self._catch(signal.SIGTERM)  # what the agent sends back when it shuts down
        accelerator.wait_for_everyone()  # every rank counts signals from here on
        before = self.received
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restarts > 0 and os.environ.get("LOCAL_RANK") == "0" and os.getppid() != 1:
            # torch elastic's agent (the workers' parent) would count the exit as a failure and
            # restart; SIGTERM makes it shut down instead, forwarding SIGTERM to its workers.
            os.kill(os.getppid(), signal.SIGTERM)
        if restarts > 0:
            end = time.monotonic() + _AGENT_ACK_S
            while self.received == before and time.monotonic() < end:
                time.sleep(0.01)
        for signum in {signal.SIGTERM, self.signum}:
            signal.signal(signum, signal.SIG_IGN)  # nothing left to stop: see the module docstring
        sys.stdout.flush()
        sys.exit(PREEMPTED_EXIT_CODE)


class _Deadline:
    """A daemon thread that, once a loop of its own has asked `preempted()`, watches for a signal
    counted and not agreed on: when no ask came for `_DEADLINE_FACTOR` times the longest interval
    between two asks (from attach to the first one included), and at least `DEADLINE_FLOOR_S`,
    since the later of the last ask and the moment it saw the signal, the loop is taken to be over
    (its final evaluation, save or upload) and the signal gets its own action (`Preemption.expire`).
    Before the first ask nothing is known of the loop's pace, and nothing fires."""

    def __init__(self, preemption: Preemption) -> None:
        self._preemption = preemption
        self._last_ask = time.monotonic()  # until the first ask: when the loop started
        self._longest = 0.0  # the longest interval between two asks (attach to the first included)
        self._asks = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="accel_gradsync-preemption", daemon=True)
        self._thread.start()

    def asked(self) -> None:
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last_ask)
        self._last_ask, self._asks = now, self._asks + 1

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        seen_at: float | None = None
        while not self._stopped.wait(0.1):
            preemption = self._preemption
            if not preemption.received or preemption.agreed or not self._asks:
                continue
            seen_at = seen_at or time.monotonic()
            allowed = max(DEADLINE_FLOOR_S, _DEADLINE_FACTOR * self._longest)
            if time.monotonic() > max(seen_at, self._last_ask) + allowed:
                preemption.expire()
                return
