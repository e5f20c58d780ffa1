"""accel_gradsync: choose, per FSDP unit, between per-micro-batch and deferred gradient sync
during gradient accumulation, inside Hugging Face Accelerate and the transformers Trainer."""

from .attach import attach
from .config import DEFAULTS, ENV_PREFIX, GradSyncConfig
from .cpu import enable_cpu_fsdp
from .errors import GradSyncWarning
from .handle import GradSyncHandle
from .policies import POLICIES

__all__ = [
    "DEFAULTS",
    "ENV_PREFIX",
    "POLICIES",
    "GradSyncConfig",
    "GradSyncHandle",
    "GradSyncWarning",
    "attach",
    "enable_cpu_fsdp",
]
__version__ = "0.1.0"
