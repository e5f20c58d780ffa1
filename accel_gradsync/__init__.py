"""accel_gradsync: choose, per FSDP unit, between per-micro-batch and deferred gradient sync
during gradient accumulation, inside Hugging Face Accelerate and the transformers Trainer.

Layers, each importing only those before it: `config` < `compat` (shims for other libraries) <
`planning` (units, costs, policies) < `runtime` (binding, the window, counters, hooks) <
`estimator`; `attach` composes them.
"""

from accel_gradsync.attach import attach
from accel_gradsync.compat.cpu import enable_cpu_fsdp
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.launch import check_launch
from accel_gradsync.planning.units import Level, Plan, Unit
from accel_gradsync.runtime.handle import GradSyncHandle
from accel_gradsync.runtime.preemption import PREEMPTED_EXIT_CODE

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
]
__version__ = "0.1.0"
