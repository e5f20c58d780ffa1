"""The per-instance subclass `attach` gives a Trainer whose model transformers sharded at load time.

`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=..., dp_replicate_size=...))`
gives a model FSDP2 already wraps, which accelerate does not prepare. For such a model
transformers' `Trainer` does not enter `accelerator.no_sync` on the micro-batches that do not end
an optimizer step: it enters its own `_defer_fsdp_gradient_reduction()`, which defers every unit
(`set_requires_gradient_sync(False)`, under HSDP `set_requires_all_reduce(False)`) and ends with
`set_requires_gradient_sync(True)`. That is full deferral whatever the user chose, so the one
trainer instance gets a subclass of its own class (as accelerator_hook.py does for the
Accelerator) whose `_defer_fsdp_gradient_reduction()` enters the window's `no_sync` instead:
every sync mode then applies to the model as it does to one accelerate prepared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

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
