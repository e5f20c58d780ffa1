"""`auto`'s plan, saved with accelerate's checkpoints and put back on load.

`auto` syncs a run's first optimizer step every micro-batch while it measures, then plans from
what it measured. A run resumed from a checkpoint would measure again, syncing per micro-batch a
window the uninterrupted run held: the same gradients summed in another order, so other bits in
the weights and the optimizer state. So `save_state` writes each `auto` model's plan (each unit's
level) and its record (agreed peaks, steps measured, quiet steps, plan changes) beside the
checkpoint, and `load_state` puts them back: the resumed run goes on with that plan, and when the
checkpoint was taken at a window boundary it re-plans at its first window start, as the
uninterrupted run did there, from the peak the resumed process measures. A Trainer saves its
checkpoints without `save_state`, so its callback writes the plans at each save (`on_trainer_save`)
and reads them back once it has resumed and bound the model (`after_trainer_load`).
"""

from __future__ import annotations

import json
import os

from .optimizer_state import trainer_checkpoint
from .policies import Plan
from .state import Attachment, BoundModel

NOT_READ = -1
"""An `auto_read_at` no step count has: the next window start re-plans."""


class PlanCheckpoint:
    """accelerate's save/load pre-hooks for the `auto` plans of one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state

    def on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        path = self._path(output_dir)
        plans = [_describe(b) for b in self.state.bound.values() if b.auto is not None]
        if plans:
            with open(path, "w") as f:
                json.dump(plans, f)
        elif os.path.exists(path):
            os.remove(path)  # a checkpoint over an older one of an auto run

    def on_load_state(self, models: list, input_dir: str) -> None:
        path = self._path(input_dir)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        bound = [b for b in self.state.bound.values() if b.auto is not None]
        if len(saved) != len(bound):
            raise ValueError(
                f"accel_gradsync: {path} holds the auto plans of {len(saved)} model(s) but this run has "
                f"{len(bound)} model(s) under sync mode auto; load the checkpoint with the models it was saved with."
            )
        for model, record in zip(bound, saved, strict=True):
            _restore(model, record)

    def on_trainer_save(self, checkpoint: str) -> None:
        """After the Trainer wrote `checkpoint` (its `on_save` event)."""
        if os.path.isdir(checkpoint):  # not rotated away by save_total_limit
            self.on_save_state([], [], checkpoint)

    def after_trainer_load(self) -> None:
        """At train begin, once a resuming Trainer has loaded its checkpoint and the model is bound."""
        trainer = self.state.trainer
        checkpoint = trainer_checkpoint(trainer) if trainer is not None and trainer.state.global_step else None
        if checkpoint is not None:
            self.on_load_state([], checkpoint)

    def _path(self, directory: str) -> str:
        return os.path.join(directory, f"accel_gradsync_plan_rank{self.state.accelerator.process_index}.json")


def _describe(bound: BoundModel) -> dict:
    plan, auto = bound.plan, bound.auto
    assert auto is not None  # saved for auto's models only
    return {
        "mode": plan.mode,
        "held_sync": plan.held_sync,
        "reason": plan.reason,
        "held": [u.name for u in plan.held],
        "windowed": [u.name for u in plan.windowed],
        "peaks": list(auto.peaks),
        "measured_steps": auto.measured_steps,
        "quiet": auto.quiet,
        "changes": auto.changes,
        "mid_window": bound.account.current.micro_batches > 0,
    }


def _restore(bound: BoundModel, record: dict) -> None:
    auto, units = bound.auto, {u.name: u for u in bound.adapter.units}
    assert auto is not None  # restored for auto's models only
    missing = sorted(set(record["held"]) - set(units))
    if missing:
        raise ValueError(
            f"accel_gradsync: the checkpoint's auto plan holds units {missing} that model {bound.name!r} "
            "does not have; load the checkpoint with the model and FSDP wrapping it was saved with."
        )
    held = [units[n] for n in record["held"]]
    windowed = [units[n] for n in record["windowed"]]
    bound.plan = Plan(record["mode"], held, held_sync=record["held_sync"], windowed=windowed, reason=record["reason"])
    auto.peaks.clear()
    auto.peaks.extend(record["peaks"])
    auto.measured_steps, auto.quiet, auto.changes = record["measured_steps"], record["quiet"], record["changes"]
    # Mid-window, the window under way keeps the plan; at a boundary the next window start re-plans.
    bound.auto_read_at = bound.account.optimizer_steps if record["mid_window"] else NOT_READ
