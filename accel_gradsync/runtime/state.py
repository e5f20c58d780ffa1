"""What one `attach()` keeps: the accelerator, the config and, per bound model, its adapter, plan
and counters.

The modules that act on it (bind.py, window.py, checkpoint.py) share this state rather than the
handle, so none of them imports the handle and the handle stays a facade over them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import GradSyncConfig
from accel_gradsync.planning.policies import SyncPolicy
from accel_gradsync.planning.replan import MeasuredAuto
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.accounting import SyncAccounting
from accel_gradsync.runtime.fsdp import ModelAdapter


@dataclass
class BoundModel:
    """A prepared model with trainable units: what `bind` found and decided for it."""

    name: str
    """The user's class name, `#2`-suffixed when another bound model has it (stats() keys)."""
    adapter: ModelAdapter
    plan: Plan
    account: SyncAccounting
    auto: MeasuredAuto | None = None
    """`auto` over more than one micro-batch: measures step 1, re-plans at window starts."""
    auto_read_at: int = 0
    """The optimizer steps done when `auto` last read a peak: it reads once per finished step. A
    window an exception ended is no step (no optimizer state yet after a first one): its peak
    counts into the next window's, which auto then reads."""

    def stats(self) -> dict:
        """This model's `stats()`: the counters, with the plan's levels and `auto`'s record read
        from their owners (the plan, `auto`) at the time of asking."""
        levels = {u.name: self.plan.level(u) for u in self.adapter.units}
        if self.auto is None:
            return self.account.stats(self.plan.mode, levels)
        return self.account.stats(self.plan.mode, levels, self.auto.changes, list(self.auto.peaks))


@dataclass
class Attachment:
    """The accelerator and config of one `attach()`, and every model it has seen, by `root_of(model)`."""

    accelerator: Accelerator
    config: GradSyncConfig
    policy: SyncPolicy
    trainer: Any = None
    adapters: dict[nn.Module, ModelAdapter | None] = field(default_factory=dict)
    """Every model `bind` inspected; None where it is not wrapped (accelerate's no_sync applies)."""
    bound: dict[nn.Module, BoundModel] = field(default_factory=dict)
    """The models with trainable units, in bind order (the first one is the default of plan())."""
    warned: set[str] = field(default_factory=set)
    window_seen: int = 0
    """Micro-batches of the first window of a loop that holds them with `no_sync` outside
    `accumulate()` while the Accelerator says one per step (0 until such a window ends)."""

    @property
    def micro_batches_per_step(self) -> int:
        """M: micro-batches per optimizer step (the Trainer keeps it outside accelerate; a loop
        with `no_sync` and `gradient_accumulation_steps=1` shows it in its first window)."""
        if self.trainer is not None:
            return int(self.trainer.args.gradient_accumulation_steps)
        return int(self.accelerator.gradient_accumulation_steps) if not self.window_seen else self.window_seen

    def warn_once(self, key: str, message: str) -> None:
        """A warning that would otherwise repeat every micro-batch or checkpoint, once per attach."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, GradSyncWarning, stacklevel=4)


def root_of(model: nn.Module) -> nn.Module:
    """The module a model is known by: DDP's inner module (accelerate lists DDP models unwrapped
    and the forward hooks sit inside DDP's wrapper), else the model itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model
