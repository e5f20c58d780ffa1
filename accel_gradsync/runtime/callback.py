"""The Trainer side of `attach`: bind the prepared model before the first step, put the counters
into every log so they reach TensorBoard/W&B through `report_to`, and reshard what forwards
without gradients kept (`gather_for_generation`) when an evaluation, a prediction or training ends:
otherwise only the next training step releases them, and after the last step none comes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accel_gradsync.config.settings import GradSyncConfig, SyncMode

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
AUTO_COUNTERS = {"plan_changes": "plan_changes", "measured_peak_bytes": "measured_peak_bytes"}


def log_counters(stats: dict, everything: bool = False) -> dict:
    """The `grad_sync/` entries of one Trainer log: the few per-step counters (all-reduces only
    where there are some: DDP, HSDP; plan changes and the measured peak only under auto), or
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
    """Binds `trainer`'s wrapped model at train start, logs `stats()` under `grad_sync/`, and
    releases the units kept for forwards without gradients at the end of evaluation, prediction
    and training."""

    def __init__(
        self,
        trainer: Any,
        bind: Callable[[nn.Module], object],
        stats: Callable[[], dict],
        config: GradSyncConfig,
        after_load: Callable[[], None] = lambda: None,
        on_checkpoint: Callable[[str], None] = lambda path: None,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        self.trainer = trainer
        self.after_load = after_load
        """What a resume needs besides the Trainer's own loading (optimizer_state.py, plan_checkpoint.py)."""
        self.on_checkpoint = on_checkpoint
        """What a checkpoint needs besides what the Trainer saves (plan_checkpoint.py)."""
        self.release = release
        """Reshards the units kept unsharded by forwards without gradients (generation.py)."""
        self.bind = bind
        self.stats = stats
        self.config = config

    def on_train_begin(self, args, state, control, **kwargs: Any):
        # `accelerator.prepare` ran just before this event; `model_wrapped` is what
        # the Trainer passes to `accelerator.no_sync` on every micro-batch.
        self.bind(self.trainer.model_wrapped)
        self.after_load()  # the Trainer has loaded its checkpoint, and the model is bound

    def on_evaluate(self, args, state, control, **kwargs: Any):
        self.release()

    def on_predict(self, args, state, control, metrics=None, **kwargs: Any):
        self.release()

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.release()

    def on_save(self, args, state, control, **kwargs: Any):
        self.on_checkpoint(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_log(self, args, state, control, logs=None, **kwargs: Any):
        if logs is None:
            return
        counters = log_counters(self.stats(), self.config.resolved().log_all_counters)
        logs.update(counters)  # what the reporting callbacks after us send to report_to
        if state.log_history:
            state.log_history[-1].update(counters)  # the Trainer recorded this entry just before
