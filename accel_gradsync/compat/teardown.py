"""Exit cleanly under gloo: at interpreter exit, let gloo's worker threads finish first.

What goes wrong (torch 2.13 gloo backend, CPython 3.11; seen as "terminate called without
an active exception", SIGABRT, exit code -6, after training had finished and saved):

A `ProcessGroupGloo` runs every collective on its own worker threads (`pt_gloo_runloop`,
`ProcessGroupGloo::runLoop`). A worker marks a collective complete *before* it drops its
reference to the work object, which holds the collective's tensors. When Python has already
let go of those tensors (FSDP2 frees its all-gather buffers at once), the worker's reference
is the last one, and dropping it decrefs the tensors' Python objects, which takes the GIL
(`c10::TensorImpl::decref_pyobject`). If the main thread has meanwhile begun `Py_FinalizeEx`,
CPython ends any thread that takes the GIL with `pthread_exit`; its forced unwind crosses the
work object's noexcept destructor and `std::terminate` aborts the process (the core dump
shows `~AsyncAllgatherCoalescedWork` under `PyEval_AcquireThread` in a `runLoop` thread).
Whether the worker gets the CPU before finalization is a race, lost more often on a busy
machine. `destroy_process_group()` (accelerate's `end_training`) does not prevent it: it
joins gloo's threads only when nothing else (an FSDP model, a DeviceMesh) still references
the group, and the worker may still be releasing its last work either way.

What this does, at the narrowest point: one `atexit` handler, run while the interpreter is
still whole and after the program's last collective, releases the GIL until every gloo
worker thread of this process is asleep (waiting for work), as /proc/self/task reports, on
several samples in a row. A worker that still has a work object to drop is runnable (or
wants the free GIL, which wakes it), so it is seen and waited for. A deadline keeps an exit
from hanging (a worker blocked on a dead peer sleeps too, so it does not delay exit). Outside
Linux, or with no gloo thread, the handler returns at once. `enable_cpu_fsdp()` and `attach()`
install it; it stays harmless for NCCL/HCCL runs.
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
