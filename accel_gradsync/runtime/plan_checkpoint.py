"""`auto`'s plan, saved with accelerate's checkpoints and put back on load.

`auto` syncs a run's first optimizer step every micro-batch while it measures, then plans from
what it measured. A run resumed from a checkpoint would measure again, syncing per micro-batch a
window the uninterrupted run held: the same gradients summed in another order, so other bits in
the weights and the optimizer state. So `save_state` writes each `auto` model's plan (each unit's
level) and its record (agreed peaks, steps measured, quiet steps, plan changes, the peak measured
since the last reading) beside the checkpoint, and `load_state` puts them back: the resumed run
goes on with that plan, and when the checkpoint was taken at a window boundary it re-plans at its
first window start, as the uninterrupted run did there, from the peak of the step the saving run
measured (the resumed process ran none of it).

The plan is one decision all ranks agreed on, so the main process writes it once
(`accel_gradsync_plan.json`) and every rank reads the same file: every rank goes on with the same
plan. It records the number of processes and each model's units. A plan measured on another
number of processes, or for other units, does not hold here (each rank holds another share of
the model): then every rank measures its first step again, as a fresh run does, and one warning
says so. A Trainer saves its checkpoints without `save_state`, so its callback writes the plans at
each save (`on_trainer_save`) and reads them back once it has resumed and bound the model
(`after_trainer_load`).
"""

from __future__ import annotations

import json
import os

from accel_gradsync.compat.optimizer_state import trainer_checkpoint
from accel_gradsync.planning.memory import MemoryProbe
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.checkpoint import writes_shared_files
from accel_gradsync.runtime.state import Attachment, BoundModel

PLAN_FILE = "accel_gradsync_plan.json"

NOT_READ = -1
"""An `auto_read_at` no step count has: the next window start re-plans."""


class PlanCheckpoint:
    """accelerate's save/load pre-hooks for the `auto` plans of one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state

    def on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        if not writes_shared_files(self.state):
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


class CarriedPeak(MemoryProbe):
    """A resumed run's probe until its first reading: the peak the saving run had measured since
    its last reading (the step that ended before a boundary checkpoint, the first micro-batches of
    a window) counts, as it did in the uninterrupted run; then `probe` alone."""

    def __init__(self, probe: MemoryProbe, carried: int) -> None:
        self.probe, self.carried = probe, carried

    def capacity(self) -> int:
        return self.probe.capacity()

    def reset_peak(self) -> None:
        self.carried = 0
        self.probe.reset_peak()

    def peak(self) -> int:
        return max(self.carried, self.probe.peak())


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
        "peaks": list(auto.peaks),
        # The main process's: a checkpoint may be saved without the other ranks (DDP), so no
        # collective agrees it; the resumed run's first reading agrees it with theirs.
        "unread_peak": auto.probe.peak(),
        "measured_steps": auto.measured_steps,
        "quiet": auto.quiet,
        "changes": auto.changes,
        "mid_window": bound.account.current.micro_batches > 0,
    }


def _restore(bound: BoundModel, record: dict) -> None:
    auto, units = bound.auto, {u.name: u for u in bound.adapter.units}
    assert auto is not None  # restored for auto's models only
    held = [units[n] for n in record["held"]]
    windowed = [units[n] for n in record["windowed"]]
    bound.plan = Plan(
        record["mode"],
        held,
        held_sync=record["held_sync"],
        windowed=windowed,
        reason=record["reason"],
        generation_bytes=record["generation_bytes"],
    )
    auto.peaks.clear()
    auto.peaks.extend(record["peaks"])
    auto.measured_steps, auto.quiet, auto.changes = record["measured_steps"], record["quiet"], record["changes"]
    auto.probe = CarriedPeak(auto.probe, record["unread_peak"])
    # Mid-window, the window under way keeps the plan; at a boundary the next window start re-plans.
    bound.auto_read_at = bound.account.optimizer_steps if record["mid_window"] else NOT_READ
