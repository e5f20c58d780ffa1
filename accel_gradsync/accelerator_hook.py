"""The per-instance subclass `attach` gives one Accelerator, so its `no_sync`, `accumulate` and
`prepare` reach the sync policy.

accelerate has no hook registry around these, and its classes must not be patched. So the one
accelerator instance gets a subclass of its own class (the per-instance subclassing torch's
`fully_shard` and `parametrize` use on modules); `unhook_accelerator` gives the original class
back. Both `Accelerator.accumulate()` and the Trainer's inner loop enter `self.no_sync(model)` on
every micro-batch that is not the last, so both reach the policy. Where accelerate already does
the right thing it is reused through `super()`: the root `no_sync()` of FSDP1 and DDP, and all of
`prepare`. Its FSDP2 branch is replaced, because it sets `requires_gradient_sync(True)` on every
unit on exit instead of restoring their previous state, and cannot hold only some units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from accelerate import Accelerator
from torch import nn

from .bind import wants_binding

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
