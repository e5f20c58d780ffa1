"""Exit cleanly under gloo: at interpreter exit, let gloo's worker threads finish first.

A gloo worker thread that drops the last reference to a collective's tensors after
`Py_FinalizeEx` began is ended by CPython inside a noexcept destructor, and the process aborts
("terminate called without an active exception", exit code -6) after training finished.
`install_exit_guard` adds one `atexit` handler that releases the GIL until every gloo worker
thread of this process sleeps (/proc/self/task, several samples in a row; a deadline keeps exit
from hanging). Outside Linux, or with no gloo thread, it returns at once; harmless for NCCL/HCCL.
"""

from __future__ import annotations

import atexit
import os
import time

GLOO_WORKER = "pt_gloo_runloop"  # the thread name ProcessGroupGloo gives its workers
_IDLE_SAMPLES = 5  # consecutive samples with every worker asleep
_SAMPLE_INTERVAL_S = 0.002
_DEADLINE_S = 10.0
_installed = False


def install_exit_guard() -> None:
    """Register `wait_for_gloo_workers` to run at interpreter exit (once per process)."""
    global _installed
    if not _installed:
        atexit.register(wait_for_gloo_workers)
        _installed = True


def wait_for_gloo_workers(deadline_s: float = _DEADLINE_S) -> bool:
    """Release the GIL until every gloo worker thread of this process is asleep. Returns True
    when they were (or there are none), False when the deadline passed first."""
    end = time.monotonic() + deadline_s
    idle = 0
    while idle < _IDLE_SAMPLES:
        states = gloo_worker_states()
        idle = idle + 1 if all(s in "SDI" for s in states) else 0
        if time.monotonic() > end:
            return False
        if idle < _IDLE_SAMPLES:
            time.sleep(_SAMPLE_INTERVAL_S)  # the GIL is free meanwhile: a worker that wants it gets it
    return True


def gloo_worker_states() -> list[str]:
    """The scheduler state letter (R running, S sleeping, ...) of each gloo worker thread."""
    states: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return states  # not Linux
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        if comm == GLOO_WORKER:
            states.append(stat[stat.rfind(")") + 2])
    return states
