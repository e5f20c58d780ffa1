"""The Trainer side of `attach`: bind the prepared model before the first step, and put the
counters into every log so they reach TensorBoard/W&B through `report_to`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    from .integration import GradSyncHandle

LOG_PREFIX = "grad_sync/"


class GradSyncCallback(TrainerCallback):
    def __init__(self, handle: "GradSyncHandle") -> None:
        self.handle = handle

    def on_train_begin(self, args, state, control, **kwargs: Any):
        # `accelerator.prepare` ran just before this event; `model_wrapped` is what
        # the Trainer passes to `accelerator.no_sync` on every micro-batch.
        self.handle.bind(self.handle._trainer.model_wrapped)

    def on_log(self, args, state, control, logs=None, **kwargs: Any):
        if logs is None:
            return
        counters = {LOG_PREFIX + k: v for k, v in self.handle.stats().items() if isinstance(v, (int, float))}
        logs.update(counters)  # what the reporting callbacks after us send to report_to
        if state.log_history:
            state.log_history[-1].update(counters)  # the Trainer recorded this entry just before
