"""accel_gradsync: choose, per FSDP unit, between per-micro-batch and deferred gradient sync
during gradient accumulation, inside Hugging Face Accelerate and the transformers Trainer.

Layers, each importing only those before it: `config` < `compat` (shims for other libraries) <
`planning` (units, costs, policies) < `runtime` (binding, the window, counters, hooks) <
`estimator`; `attach` (`_attach.py`) composes them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel_gradsync._attach import attach
    from accel_gradsync.compat.cpu import enable_cpu_fsdp, training_args_defaults
    from accel_gradsync.config.errors import GradSyncWarning
    from accel_gradsync.config.settings import GradSyncConfig
    from accel_gradsync.estimator.core import estimate
    from accel_gradsync.launch import check_launch
    from accel_gradsync.planning.units import Level, Plan, Unit
    from accel_gradsync.runtime.faults.preemption import PREEMPTED_EXIT_CODE
    from accel_gradsync.runtime.handle import GradSyncHandle

# Imported on first use (PEP 562), so `accel-gradsync estimate` can refuse a bad flag before
# accelerate and transformers' models are imported: name -> the module that defines it.
_LAZY = {
    "attach": "accel_gradsync._attach",
    "enable_cpu_fsdp": "accel_gradsync.compat.cpu",
    "GradSyncWarning": "accel_gradsync.config.errors",
    "GradSyncConfig": "accel_gradsync.config.settings",
    "estimate": "accel_gradsync.estimator.core",
    "check_launch": "accel_gradsync.launch",
    "Level": "accel_gradsync.planning.units",
    "Plan": "accel_gradsync.planning.units",
    "Unit": "accel_gradsync.planning.units",
    "GradSyncHandle": "accel_gradsync.runtime.handle",
    "PREEMPTED_EXIT_CODE": "accel_gradsync.runtime.faults.preemption",
    "training_args_defaults": "accel_gradsync.compat.cpu",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "GradSyncConfig",
    "GradSyncHandle",
    "GradSyncWarning",
    "Level",
    "PREEMPTED_EXIT_CODE",
    "Plan",
    "Unit",
    "attach",
    "check_launch",
    "enable_cpu_fsdp",
    "estimate",
    "training_args_defaults",
]
__version__ = "0.1.0"
