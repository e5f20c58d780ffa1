"""Save on the scheduler's warning signal, then exit with `PREEMPTED_EXIT_CODE`: `Preemption` (the
signal flag and the ranks' agreement), which the Trainer callback `callback.SaveOnSignal`
(`GradSyncConfig.save_on_signal`) and a training loop of its own use.

The handler only counts the signal: no collective, I/O or lock inside a handler, so a signal during
generation, a save or a collective changes nothing there. The ranks agree at the end of every
optimizer step and after every checkpoint save (a MAX over the ranks' flags, one small collective);
when one rank got the signal, all save at that step, then exit. Under torch elastic with
`--max_restarts`, the main process of each node first tells its agent (SIGTERM), so that the agent
shuts down instead of spending a restart on the exit (docs/recipe.md, Preemption).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

PREEMPTED_EXIT_CODE = 75
"""The exit code of a process that saved on the signal and stopped (EX_TEMPFAIL: try again later)."""
NO_SIGNAL = "none"
# How long each rank waits for its agent to take the stop (its SIGTERM back): the agent forwards
# within milliseconds; the deadline only keeps a rank whose agent is gone from waiting for nothing.
_AGENT_ACK_S = 10.0


class Preemption:
    """The flag one signal sets in this process, and the ranks' agreement on it."""

    def __init__(self, signal_name: str) -> None:
        self.signum = signal.Signals[signal_name]
        self.received = 0
        self.agreed = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Count the signal from now on, instead of its own action (main thread only)."""
        self._catch(self.signum)

    def restore(self) -> None:
        """The signals' own handlers back."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _catch(self, signum: int) -> None:
        if signum not in self._previous:
            self._previous[signum] = signal.signal(signum, self._count)

    def _count(self, signum: int, frame: Any) -> None:
        self.received += 1  # the whole handler: see the module docstring

    def agree(self, accelerator: Any) -> bool:
        """True, on every rank alike, once any rank has received the signal. A collective: every
        rank calls it at the same point; once True it stays True without another one."""
        if not self.agreed:
            flag = torch.tensor([1 if self.received else 0], device=accelerator.device)
            self.agreed = bool(accelerator.gather(flag).max().item())
        return self.agreed

    def exit(self, accelerator: Any) -> None:
        """After the checkpoint: leave the agent out of restarting, then exit with `PREEMPTED_EXIT_CODE`."""
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
        sys.stdout.flush()
        sys.exit(PREEMPTED_EXIT_CODE)
