"""`auto`'s plan, saved with accelerate's checkpoints and put back on load, so a resumed run goes
on with the plan (and the measured record) the uninterrupted run had instead of measuring again.

The main process writes one file (`PLAN_FILE`) for all ranks, with the number of processes and
each model's units; on load a plan measured on another number of processes or for other units
does not hold, and every rank measures its first step again (one warning). A Trainer saves
without `save_state`, so its callback calls `on_trainer_save` / `after_trainer_load`.
"""

from __future__ import annotations

import json
import os

from accel_gradsync.compat.optimizer_state import trainer_checkpoint
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.core.state import Attachment, BoundModel

PLAN_FILE = "accel_gradsync_plan.json"


class PlanCheckpoint:
    """accelerate's save/load pre-hooks for the `auto` plans of one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state

    def on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        if not self.state.writes_shared_files():
            return
        path = os.path.join(output_dir, PLAN_FILE)
        plans = [_describe(b) for b in self.state.bound.values() if b.auto is not None]
        if plans:
            with open(path, "w") as f:
                json.dump({"processes": self.state.accelerator.num_processes, "models": plans}, f)
        elif os.path.exists(path):
            os.remove(path)  # a checkpoint over an older one of an auto run

    def on_load_state(self, models: list, input_dir: str) -> None:
        path = os.path.join(input_dir, PLAN_FILE)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        bound = [b for b in self.state.bound.values() if b.auto is not None]
        if len(saved["models"]) != len(bound):
            raise ValueError(
                f"accel_gradsync: {path} holds the auto plans of {len(saved['models'])} model(s) but this run has "
                f"{len(bound)} model(s) under sync mode auto; load the checkpoint with the models it was saved with."
            )
        processes = self.state.accelerator.num_processes
        for model, record in zip(bound, saved["models"], strict=True):
            units = [u.name for u in model.adapter.units]
            if saved["processes"] == processes and record["units"] == units:
                _restore(model, record)
                continue
            self.state.warn_once(
                f"plan:{model.name}",
                f"accel_gradsync: the auto plan of {model.name!r} in {path} was measured on {saved['processes']} "
                f"processes with {len(record['units'])} units; this run has {processes} processes and {len(units)} "
                "units, where it does not hold, so auto measures its first step again (every rank alike).",
            )

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


def _describe(bound: BoundModel) -> dict:
    plan, auto = bound.plan, bound.auto
    assert auto is not None  # saved for auto's models only
    return {
        "units": [u.name for u in bound.adapter.units],
        "mode": plan.mode,
        "held_sync": plan.held_sync,
        "reason": plan.reason,
        "generation_bytes": plan.generation_bytes,
        "held": [u.name for u in plan.held],
        "windowed": [u.name for u in plan.windowed],
        **auto.record(),
        "mid_window": bound.account.current.micro_batches > 0,
    }


def _restore(bound: BoundModel, record: dict) -> None:
    units = {u.name: u for u in bound.adapter.units}
    plan = Plan(
        record["mode"],
        [units[n] for n in record["held"]],
        held_sync=record["held_sync"],
        windowed=[units[n] for n in record["windowed"]],
        reason=record["reason"],
        generation_bytes=record["generation_bytes"],
    )
    bound.resume_auto(plan, record, record["mid_window"])
