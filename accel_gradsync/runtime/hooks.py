"""The per-instance subclasses `attach` gives one Accelerator and, for a model transformers
sharded at load time, one Trainer, so their `no_sync` (and `accumulate`, `prepare`) reach the window.

accelerate and transformers have no hook registry around these, and their classes must not be
patched: the one instance gets a subclass of its own class (the per-instance subclassing torch's
`fully_shard` uses on modules), and `unhook_*` gives the original class back. What accelerate does
right is reused through `super()` (the root `no_sync()` of FSDP1 and DDP, all of `prepare`); its
FSDP2 branch is replaced because it sets `requires_gradient_sync(True)` on every unit on exit
instead of restoring their state. transformers' Trainer defers a load-time-sharded model through
its own `_defer_fsdp_gradient_reduction()` (every unit, whatever the user chose): the subclass
enters the window's `no_sync` there instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from accelerate import Accelerator
from torch import nn

from accel_gradsync.runtime.bind import wants_binding

_HOOKED_ATTR = "_accel_gradsync_hooked"  # marks the per-instance subclass; it refers to nothing


def is_hooked(accelerator: Accelerator) -> bool:
    """True while an `attach()` on this accelerator has not been detached."""
    return getattr(type(accelerator), _HOOKED_ATTR, False)


def hook_accelerator(
    accelerator: Accelerator,
    *,
    no_sync: Callable,
    abort: Callable[[], None],
    window_ends: Callable[[], None],
    bind: Callable[[nn.Module], Any],
) -> type:
    """Give `accelerator` a subclass of its class whose `no_sync` enters `no_sync(model,
    accelerate_no_sync)`, whose `accumulate` calls `window_ends()` on entering a micro-batch that
    syncs and `abort()` when an exception leaves it, and whose `prepare` binds the models it
    wraps. Returns the original class."""
    base = type(accelerator)

    class GradSyncAccelerator(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def no_sync(self, model):  # accelerate's signature
            with no_sync(model, super().no_sync):
                yield

        @contextlib.contextmanager
        def accumulate(self, *models):
            with super().accumulate(*models):
                if self.sync_gradients:
                    window_ends()  # before the last forward: the flags the window held come back
                try:
                    yield
                except BaseException:
                    abort()
                    self.step = 0  # accelerate's window counter: the next window starts fresh
                    raise

        def prepare(self, *args, **kwargs):
            result = super().prepare(*args, **kwargs)
            # One object comes back alone; several as a tuple (a list under FSDP2).
            for obj in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(obj, nn.Module) and wants_binding(self, obj):
                    bind(obj)
            return result

    GradSyncAccelerator.__name__ = GradSyncAccelerator.__qualname__ = f"GradSync{base.__name__}"
    setattr(GradSyncAccelerator, _HOOKED_ATTR, True)
    accelerator.__class__ = GradSyncAccelerator
    return base


def unhook_accelerator(accelerator: Accelerator, original: type) -> None:
    """Give `accelerator` its own class back: accelerate's `no_sync`, `accumulate` and `prepare` again."""
    accelerator.__class__ = original


_DEFER = "_defer_fsdp_gradient_reduction"  # transformers 5.x, Trainer


def sharded_by_transformers(trainer: Any) -> bool:
    """True when `trainer`'s model was sharded at load time by transformers (`DistributedConfig`)."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def watch_replicated_all_reduces(trainer: Any, params: list, record: Callable[[], None]) -> list:
    """Count the all-reduces transformers' Trainer issues itself for `params`, trainable
    parameters FSDP2 does not manage (an adapter added after load-time sharding): its
    `_sync_replicated_trainable_parameters` gives each a post-accumulate-grad hook that averages
    the gradient over all ranks when the accelerator syncs gradients (the window's last backward).
    One hook of the same kind per parameter calls `record` on the same condition; returns the
    handles."""
    import torch.distributed as dist

    if not (sharded_by_transformers(trainer) and dist.is_initialized() and dist.get_world_size() > 1):
        return []  # transformers issues none

    def count(_param: Any) -> None:
        if trainer.accelerator.sync_gradients:
            record()

    return [p.register_post_accumulate_grad_hook(count) for p in params]


def hook_trainer(trainer: Any, no_sync: Callable) -> type:
    """Give `trainer` a subclass of its class whose `_defer_fsdp_gradient_reduction()` enters
    `no_sync(model, transformers_deferral)`. Returns the original class. Raises `ValueError` when
    this transformers release defers through another method, so nothing runs ungoverned."""
    base = type(trainer)
    if not callable(getattr(base, _DEFER, None)):
        import transformers

        raise ValueError(
            f"accel_gradsync cannot choose the gradient sync of a model sharded at load time "
            f"(DistributedConfig) under transformers {transformers.__version__}: its Trainer has no {_DEFER}(), "
            "which transformers 5.24 enters on every micro-batch that does not end an optimizer step. Shard the "
            "model with accelerate instead (fsdp_version: 2 in the accelerate config, from_pretrained without "
            "distributed_config), or install transformers 5.24."
        )

    class GradSyncTrainer(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:  # transformers' signature
            model: nn.Module = self.model
            with no_sync(model, lambda _model: super(GradSyncTrainer, self)._defer_fsdp_gradient_reduction()):
                yield

    GradSyncTrainer.__name__ = GradSyncTrainer.__qualname__ = f"GradSync{base.__name__}"
    trainer.__class__ = GradSyncTrainer
    return base


def discarding_on_exception(no_sync: Callable, abort: Callable[[], None]) -> Callable:
    """The `no_sync` a Trainer enters (accelerate's, or through `hook_trainer` transformers' own
    deferral): as `no_sync`, and an exception leaving it discards the window with `abort()`. The
    Trainer has no `accumulate()` to do that, and the window's held gradients live where the
    next `zero_grad` does not reach (FSDP2 keeps them outside `.grad`): a Trainer that retries
    (`auto_find_batch_size` after an out-of-memory error) would add them into the next window."""

    @contextlib.contextmanager
    def trainer_no_sync(model: nn.Module, inner: Callable) -> Iterator[None]:
        try:
            with no_sync(model, inner):
                yield
        except BaseException:
            abort()
            raise

    return trainer_no_sync


def unhook_trainer(trainer: Any, original: type) -> None:
    """Give `trainer` its own class back: transformers' deferral again."""
    trainer.__class__ = original
