"""The Trainer side of `attach`: bind the prepared model before the first step, put the counters
into every log so they reach TensorBoard/W&B through `report_to`, and reshard what forwards
without gradients kept (`gather_for_generation`) when an evaluation, a prediction or training ends:
otherwise only the next training step releases them, and after the last step none comes.
`SaveOnSignal` (`save_on_signal`) saves and stops on the scheduler's signal (preemption.py); on
SIGTERM it takes the place of transformers' own `enable_jit_checkpoint`, whose ranks each decide
on a timer of their own (so may save at different steps)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import SyncMode
from accel_gradsync.runtime.core.state import Attachment
from accel_gradsync.runtime.faults.checkpoint import CheckpointHooks
from accel_gradsync.runtime.faults.preemption import PREEMPTED_EXIT_CODE, Preemption
from accel_gradsync.runtime.generating.generation import GenerationGather
from accel_gradsync.runtime.integration.bind import Binder

LOG_PREFIX = "grad_sync/"
# The per-step counters a log line carries by default: log key -> stats() key.
STEP_COUNTERS = {
    "reduce_scatters": "last_step/reduce_scatters_issued",
    "reduce_scatters_skipped": "last_step/reduce_scatters_skipped",
    "held_grad_bytes": "last_step/held_grad_bytes",
    "units_windowed": "units_windowed",
    "units_deferred": "units_deferred",
    "units_per_micro_batch": "units_per_micro_batch",
}
ALL_REDUCE_COUNTERS = {
    "all_reduces": "last_step/all_reduces_issued",
    "all_reduces_skipped": "last_step/all_reduces_skipped",
}
AUTO_COUNTERS = {
    "plan_changes": "plan_changes",
    "measured_peak_bytes": "measured_peak_bytes",
    "forecast_peak_bytes": "forecast_peak_bytes",
}


def log_counters(stats: dict, everything: bool = False) -> dict:
    """The `grad_sync/` entries of one Trainer log: the few per-step counters (all-reduces only
    where there are some: DDP, HSDP; plan changes, the measured and the forecast peak only under auto), or
    with `everything` every numeric counter."""
    if everything:
        return {LOG_PREFIX + k: v for k, v in stats.items() if isinstance(v, (int, float))}
    keys = dict(STEP_COUNTERS)
    if stats.get("wrapper") == "ddp" or stats.get("hsdp"):
        keys.update(ALL_REDUCE_COUNTERS)
    if stats.get("mode_selected") == SyncMode.AUTO:
        keys.update(AUTO_COUNTERS)
    return {LOG_PREFIX + name: stats[key] for name, key in keys.items() if key in stats}


class GradSyncCallback(TrainerCallback):
    """Binds the Trainer's wrapped model at train start, logs `stats()` under `grad_sync/`,
    saves and loads what a checkpoint needs besides the Trainer's files, and releases the units
    kept for forwards without gradients at the end of evaluation, prediction and training."""

    def __init__(
        self, state: Attachment, binder: Binder, generation: GenerationGather, checkpoints: CheckpointHooks
    ) -> None:
        self.state = state
        self.trainer = state.trainer
        self.binder = binder
        self.generation = generation
        self.checkpoints = checkpoints

    def on_train_begin(self, args, state, control, **kwargs: Any):
        # `accelerator.prepare` ran just before this event; `model_wrapped` is what
        # the Trainer passes to `accelerator.no_sync` on every micro-batch.
        self.binder.bind(self.trainer.model_wrapped)
        self.checkpoints.after_trainer_load()  # the Trainer has loaded its checkpoint, and the model is bound

    def on_evaluate(self, args, state, control, **kwargs: Any):
        self.generation.release()

    def on_predict(self, args, state, control, metrics=None, **kwargs: Any):
        self.generation.release()

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.generation.release(resident=True)  # a resident reference model too: nothing trains after this

    def on_save(self, args, state, control, **kwargs: Any):
        self.checkpoints.on_trainer_save(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_log(self, args, state, control, logs=None, **kwargs: Any):
        if logs is None:
            return
        counters = log_counters(self.state.stats(), self.state.settings.log_all_counters)
        logs.update(counters)  # what the reporting callbacks after us send to report_to
        if state.log_history:
            state.log_history[-1].update(counters)  # the Trainer recorded this entry just before


class SaveOnSignal(TrainerCallback):
    """On `signal_name`, the Trainer saves a checkpoint at the end of the optimizer step in progress
    (or right after a save already running) and stops; at train end the process exits with
    `PREEMPTED_EXIT_CODE`, so nothing after `train()` (a final save) runs as if training had ended."""

    def __init__(self, trainer: Any, preemption: Preemption) -> None:
        self.accelerator = trainer.accelerator
        self.preemption = preemption
        take_over_jit_checkpoint(trainer, preemption.signum)
        self.preemption.install()  # from attach on: a signal while the model loads is not lost

    def on_step_end(self, args, state, control, **kwargs: Any):
        if self.preemption.agree():
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs: Any):
        if self.preemption.agree():
            control.should_training_stop = True  # this save is complete once on_save returns (resume.py)

    def on_train_end(self, args, state, control, **kwargs: Any):
        if not self.preemption.agreed:
            self.preemption.restore()
            return
        name = self.preemption.signum.name
        self.accelerator.print(
            f"accel_gradsync: {name}: saved checkpoint-{state.global_step} in {args.output_dir}; exiting with "
            f"code {PREEMPTED_EXIT_CODE}. --resume_from_checkpoint auto continues from it."
        )
        self.preemption.exit(self.accelerator)


def take_over_jit_checkpoint(trainer: Any, signum: int) -> None:
    """With `TrainingArguments.enable_jit_checkpoint` and `save_on_signal` both on SIGTERM, only
    `save_on_signal` acts (its ranks agree on the step), with one warning: transformers' callback
    leaves the Trainer, and its own `on_train_end` gives SIGTERM back the handler it had before the
    Trainer was built, which `Preemption.install` then replaces."""
    if signum != signal.SIGTERM or not getattr(trainer.args, "enable_jit_checkpoint", False):
        return
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    for callback in [c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]:
        trainer.remove_callback(callback)
        callback.on_train_end(trainer.args, trainer.state, trainer.control)
    warnings.warn(
        "accel_gradsync: TrainingArguments.enable_jit_checkpoint and save_on_signal='SIGTERM' both save on "
        "SIGTERM; save_on_signal acts alone (every rank saves at the same optimizer step), transformers' JIT "
        "checkpoint is off for this Trainer.",
        GradSyncWarning,
        stacklevel=5,  # attach()'s caller
    )
