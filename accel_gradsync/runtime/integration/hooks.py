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
from collections.abc import Iterator
from typing import Any

from accelerate import Accelerator
from torch import nn

from accel_gradsync.compat.releases import TRAINER_DEFER, TRAINER_DEFER_SINCE
from accel_gradsync.planning.residency import splits_frozen
from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.integration.bind import Binder, wants_binding
from accel_gradsync.runtime.uneven_inputs.join import Join
from accel_gradsync.runtime.uneven_inputs.uneven_steps import UnevenSteps
from accel_gradsync.runtime.wrappers.frozen_units import applies

_HOOKED_ATTR = "_accel_gradsync_hooked"  # marks the per-instance subclass; it refers to nothing
_DEFER = TRAINER_DEFER  # transformers 5.23 on, Trainer


def is_hooked(accelerator: Accelerator) -> bool:
    """True while an `attach()` on this accelerator has not been detached."""
    return getattr(type(accelerator), _HOOKED_ATTR, False)


def hook_accelerator(
    accelerator: Accelerator,
    binder: Binder,
    window: Window,
    join: Join,
    steps: UnevenSteps,
    discard_on_exception: bool,
) -> type:
    """Give `accelerator` a subclass of its class whose `no_sync` binds the model and enters the
    window's, whose `accumulate` ends the window's hold on entering a micro-batch that syncs and
    aborts the window when an exception leaves it, and whose `prepare` binds the models it wraps;
    `accumulate`, `backward`, `clip_grad_norm_`, the loop's collectives (`gather`, `reduce`, ...),
    `wait_for_everyone` and `save_state`/`load_state` also serve `grad_sync.join()` (join.py), and
    `accumulate`, `backward`, `clip_grad_norm_` and the loop's collectives `grad_sync.step(n)`
    (uneven_steps.py); `clip_grad_norm_` tells the window too (a clip inside a held micro-batch).
    `discard_on_exception`: a Trainer's `no_sync` aborts the window itself (`Window.no_sync`).
    Returns the original class."""
    base = type(accelerator)

    class GradSyncAccelerator(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def no_sync(self, model):  # accelerate's signature
            binder.bind(model)
            with window.no_sync(model, super().no_sync, discard_on_exception):
                yield

        @contextlib.contextmanager
        def accumulate(self, *models):
            # Inside join(): who still trains, before any collective of this micro-batch.
            with join.micro_batch(models):
                for model in models:
                    # A DDP model prepared before attach (accelerate lists it unwrapped) binds here,
                    # even at a step's only micro-batch; a bound one is refreshed (bind.py).
                    binder.bind(model)
                with super().accumulate(*models):
                    if steps.begin(models):  # step(n): this rank's last, replayed up to the largest count
                        for model in models:
                            steps.hold(window.no_sync(model, super().no_sync))
                    elif self.sync_gradients:
                        window.end_hold()  # before the last forward: the flags the window held come back
                        if steps.keeps_windowed():  # step(n)'s free last: gathered as a held one is
                            window.kept.keep_every_model()
                    try:
                        yield
                        steps.flush()  # step(n): the replays, where the loop stepped outside the block
                    except BaseException:
                        steps.abort()
                        window.abort()
                        self.step = 0  # accelerate's window counter: the next window starts fresh
                        raise
                    finally:
                        steps.leave()

        def clip_grad_norm_(self, parameters, max_norm, norm_type=2):  # accelerate's signature
            steps.clip()  # step(n): the last micro-batch's replays first; refused between two on FSDP
            window.on_clip()  # a clip inside a held micro-batch of a plan that holds some units
            parameters = join.clip(parameters, max_norm, norm_type)  # inside join(): a rank that left clips too
            return super().clip_grad_norm_(parameters, max_norm, norm_type)

        def wait_for_everyone(self):
            join.refuse_inside("accelerator.wait_for_everyone()")  # a rank that left would never come
            join.check_even("accelerator.wait_for_everyone()")  # uneven counts without join()
            super().wait_for_everyone()

        def backward(self, loss, **kwargs):
            join.backward()  # inside join(): a rank that left backs up its replay here too
            steps.backward()
            return super().backward(loss, **kwargs)

        # Inside join(): a rank that left issues each of these with zeros, as DDP's Join does.
        def gather(self, tensor):
            steps.loop_collective("gather")
            with join.loop_collective("gather", tensor, {}):
                return super().gather(tensor)

        def gather_for_metrics(self, input_data, use_gather_object=False):
            steps.loop_collective("gather_for_metrics")
            with join.loop_collective("gather_for_metrics", input_data, {"use_gather_object": use_gather_object}):
                return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)

        def reduce(self, tensor, reduction="sum", scale=1.0):
            steps.loop_collective("reduce")
            with join.loop_collective("reduce", tensor, {"reduction": reduction, "scale": scale}):
                return super().reduce(tensor, reduction=reduction, scale=scale)

        def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
            kwargs = {"dim": dim, "pad_index": pad_index, "pad_first": pad_first}
            steps.loop_collective("pad_across_processes")
            with join.loop_collective("pad_across_processes", tensor, kwargs):
                return super().pad_across_processes(tensor, **kwargs)

        def save_state(self, *args, **kwargs):
            join.refuse_inside("accelerator.save_state()")  # before a file is written
            return super().save_state(*args, **kwargs)

        def load_state(self, *args, **kwargs):
            join.refuse_inside("accelerator.load_state()")
            return super().load_state(*args, **kwargs)

        def prepare(self, *args, **kwargs):
            state = binder.state
            splits = splits_frozen(state.settings) and applies(self)
            taken = sum(f.kept_bytes for f in state.frozen.values() if f.resident)
            if splits:  # adapters in units of their own, before accelerate shards
                state.residency.split(self, args, state.settings, binder.memory.free, taken)
            result = super().prepare(*args, **kwargs)
            # One object comes back alone; several as a tuple (a list under FSDP2).
            objs = result if isinstance(result, (tuple, list)) else (result,)
            models = [obj for obj in objs if isinstance(obj, nn.Module) and wants_binding(self, obj)]
            if splits:
                for model in models:  # before bind: the units it reads keep their params
                    state.residency.keep(model, state.settings, binder.memory.free, taken)
            # Frozen models first: budget and auto plan the trained ones within what those keep.
            for model in sorted(models, key=lambda m: any(p.requires_grad for p in m.parameters())):
                binder.bind(model)
            return result

    GradSyncAccelerator.__name__ = GradSyncAccelerator.__qualname__ = f"GradSync{base.__name__}"
    setattr(GradSyncAccelerator, _HOOKED_ATTR, True)
    accelerator.__class__ = GradSyncAccelerator
    return base


def unhook_accelerator(accelerator: Accelerator, original: type) -> None:
    """Give `accelerator` its own class back: accelerate's `no_sync`, `accumulate` and `prepare` again."""
    accelerator.__class__ = original


def hook_trainer(trainer: Any, binder: Binder, window: Window) -> type:
    """Give `trainer` (whose model transformers sharded at load time) a subclass of its class whose
    `_defer_fsdp_gradient_reduction()` enters the window's `no_sync` instead of deferring every
    unit. Returns the original class. Raises `ValueError` when this transformers release defers
    through another method, so nothing runs ungoverned."""
    base = type(trainer)
    if not callable(getattr(base, _DEFER, None)):
        import transformers

        raise ValueError(
            f"accel_gradsync cannot choose the gradient sync of a model sharded at load time "
            f"(DistributedConfig) under transformers {transformers.__version__}: its Trainer has no {_DEFER}(), "
            f"which transformers {TRAINER_DEFER_SINCE} and later enter on every micro-batch that does not end an "
            "optimizer step. Shard the model with accelerate instead (fsdp_version: 2 in the accelerate config, "
            f"from_pretrained without distributed_config), or install transformers>={TRAINER_DEFER_SINCE}."
        )

    class GradSyncTrainer(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:  # transformers' signature
            model: nn.Module = self.model
            binder.bind(model)
            deferral = super()._defer_fsdp_gradient_reduction
            with window.no_sync(model, lambda _model: deferral(), discard_on_exception=True):
                yield

    GradSyncTrainer.__name__ = GradSyncTrainer.__qualname__ = f"GradSync{base.__name__}"
    trainer.__class__ = GradSyncTrainer
    return base


def unhook_trainer(trainer: Any, original: type) -> None:
    """Give `trainer` its own class back: transformers' deferral again."""
    trainer.__class__ = original
