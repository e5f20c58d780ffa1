"""`Connection`: what one `attach()` puts into the Accelerator and the Trainer, and takes out again
at `detach()`. accelerate's per-instance class (hooks.py: `no_sync`, `accumulate`, `prepare` reach
the window), the checkpoint hooks (checkpoint.py), join()'s check of even counts (uneven.py), the
Trainer's `GradSyncCallback` and, for a model transformers sharded at load time, the Trainer's
per-instance class (callback.py, hooks.py), and with `save_on_signal` the signal handler or the
Trainer's `SaveOnSignal` (preemption.py). `GradSyncHandle` owns one; each piece goes in once and
comes out once, and `disconnect` is safe to call again.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.core.state import Attachment
from accel_gradsync.runtime.faults.checkpoint import CheckpointHooks
from accel_gradsync.runtime.faults.preemption import NO_SIGNAL, Preemption
from accel_gradsync.runtime.generating.generation import GenerationGather
from accel_gradsync.runtime.integration.bind import Binder
from accel_gradsync.runtime.integration.hooks import hook_accelerator, hook_trainer, unhook_accelerator, unhook_trainer
from accel_gradsync.runtime.uneven_inputs.join import Join
from accel_gradsync.runtime.uneven_inputs.uneven_steps import UnevenSteps
from accel_gradsync.runtime.wrappers.adapt import sharded_by_transformers


class Connection:
    """The hooks, callbacks and signal handler one `attach()` installed, until `disconnect`."""

    def __init__(
        self,
        accelerator: Accelerator,
        state: Attachment,
        binder: Binder,
        window: Window,
        generation: GenerationGather,
        checkpoints: CheckpointHooks,
        join: Join,
        steps: UnevenSteps,
    ) -> None:
        self.accelerator = accelerator
        self._state, self._binder, self._window, self._generation = state, binder, window, generation
        self._checkpoints, self._join, self._steps = checkpoints, join, steps
        self.preemption: Preemption | None = None
        """With `save_on_signal`: the Trainer's or the loop's (`GradSyncHandle.preempted`)."""
        self._callback: Any = None  # callback.GradSyncCallback, with a Trainer
        self._save_on_signal: Any = None  # callback.SaveOnSignal, with a Trainer and save_on_signal
        self._original_class: type | None = None
        self._original_trainer_class: type | None = None  # a model transformers sharded (hooks.py)

    def add_save_on_signal(self) -> None:
        """When `save_on_signal` names a signal, also on one process: a Trainer's `SaveOnSignal`,
        last in line (the other callbacks' on_train_end run before it exits); for a loop of its
        own, the handler and the watch for a loop that never asks `preempted()`."""
        signal_name, trainer = self._state.settings.save_on_signal, self._state.trainer
        if signal_name == NO_SIGNAL:
            return
        self.preemption = Preemption(signal_name, self._state.control)
        if trainer is None:
            self.preemption.install()
            self.preemption.watch_loop()
            return
        from accel_gradsync.runtime.integration.callback import SaveOnSignal  # imports transformers: only for a Trainer

        self._save_on_signal = SaveOnSignal(trainer, self.preemption)
        trainer.add_callback(self._save_on_signal)

    def connect(self) -> None:
        """Put the policy behind the accelerator's `no_sync` / `accumulate` / `prepare`, its
        checkpoints and the Trainer's events (after the models prepared before attach are bound)."""
        trainer = self._state.trainer
        # accelerate's checkpoints hold no gradients: a mid-window one gets them from us.
        self._checkpoints.register()
        if trainer is not None:
            from accel_gradsync.runtime.integration.callback import (
                GradSyncCallback,  # imports transformers: only for a Trainer
            )

            self._callback = GradSyncCallback(self._state, self._binder, self._generation, self._checkpoints)
            # First in line, so the reporting callbacks (TensorBoard, W&B, ...) see our keys.
            trainer.callback_handler.callbacks.insert(0, self._callback)
            if sharded_by_transformers(trainer):
                self._original_trainer_class = hook_trainer(trainer, self._binder, self._window)
        self._join.even.register()
        self._original_class = hook_accelerator(
            self.accelerator,
            self._binder,
            self._window,
            self._join,
            self._steps,
            discard_on_exception=trainer is not None,
        )

    def disconnect(self) -> None:
        """The accelerator's (and a Trainer's) own class back, the checkpoint and join hooks, the
        callbacks and the signal's own handler; what was never put in is skipped."""
        if self._original_class is not None:
            unhook_accelerator(self.accelerator, self._original_class)
            self._original_class = None
        self._checkpoints.close()
        self._join.close()
        self._steps.close()
        if self._callback is not None:
            self._state.trainer.remove_callback(self._callback)
            self._callback = None
        if self._save_on_signal is not None:
            self._state.trainer.remove_callback(self._save_on_signal)
            self._save_on_signal = None
        if self.preemption is not None:
            self.preemption.restore()  # the signal's own handler back
            self.preemption = None
        if self._original_trainer_class is not None:
            unhook_trainer(self._state.trainer, self._original_trainer_class)
            self._original_trainer_class = None
