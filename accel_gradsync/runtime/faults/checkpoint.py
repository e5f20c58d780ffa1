"""Everything accel_gradsync adds to a checkpoint, and the hooks that save and load it:
`CheckpointHooks` registers accelerate's save/load pre-hooks and serves the Trainer's callback.

`GradCheckpoint` keeps a window saved mid-way: accelerate's checkpoints hold no gradients, so each
rank writes its own (held or sharded) next to the checkpoint and the load pre-hook puts them back,
after FSDP loaded models and optimizers. The main process writes one note (`WINDOW_NOTE`) that
every rank reads, so all ranks decide alike: a window saved by another number of processes, or by
FSDP1 (whose gradients cannot be put back), is refused on every rank.
"""

from __future__ import annotations

import json
import os

import torch
import torch.utils.hooks

from accel_gradsync.compat.optimizer_state import OptimizerStateFix
from accel_gradsync.runtime.core.state import Attachment
from accel_gradsync.runtime.faults.plan_checkpoint import PlanCheckpoint

WINDOW_NOTE = "accel_gradsync_window.json"
"""The main process's note of a mid-window checkpoint: the window, the processes, the gradients."""


class GradCheckpoint:
    """accelerate's save/load pre-hooks for one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state

    def on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        """Mid-window, save this rank's (held or sharded) gradients next to the checkpoint."""
        state = self.state
        path, note = self._path(output_dir), os.path.join(output_dir, WINDOW_NOTE)
        done = max((b.account.current.micro_batches for b in state.bound.values()), default=0)
        grads = [a.grad_state() for a in state.adapters.values() if a is not None] if done else []
        saved = all(g is not None for g in grads)
        writes = state.writes_shared_files()
        for stale in (path, note) if writes else (path,):
            if os.path.exists(stale):
                os.remove(stale)  # a checkpoint over an older mid-window one
        if not done:
            return
        if saved:
            torch.save(grads, path)
        if writes:
            window = {"micro_batches": done, "of": state.micro_batches_per_step, "gradients_saved": saved}
            with open(note, "w") as f:
                json.dump({**window, "processes": state.accelerator.num_processes}, f)
        if not saved:
            state.warn_once(
                "save_state",
                f"accel_gradsync: save_state() after {done} of {state.micro_batches_per_step} micro-batches "
                "of an accumulation window: accelerate's checkpoint holds no gradients and FSDP1's cannot be put "
                "back, so load_state will refuse this checkpoint rather than resume without those micro-batches. "
                "Save after the optimizer step (when accelerator.sync_gradients is True) for an exact resume.",
            )

    def on_load_state(self, models: list, input_dir: str) -> None:
        note = os.path.join(input_dir, WINDOW_NOTE)
        if not os.path.exists(note):
            return  # saved at a step boundary: no window to finish
        with open(note) as f:
            window = json.load(f)
        where = (
            f"{input_dir} was saved after {window['micro_batches']} of {window['of']} micro-batches of an "
            "accumulation window"
        )
        anyway = f"or delete {note} to resume anyway without those micro-batches."
        processes = self.state.accelerator.num_processes
        if window["processes"] != processes:
            raise ValueError(
                f"accel_gradsync: {where}, by {window['processes']} processes; this run has {processes} processes, "
                "and each process saved its own shards of that window's gradients. Resume it with "
                f"{window['processes']} processes, resume from a checkpoint saved after an optimizer step, {anyway}"
            )
        if not window["gradients_saved"]:
            raise ValueError(
                f"accel_gradsync: {where}, whose gradients this wrapper (FSDP1) cannot save, so resuming from it "
                f"would lose them. Resume from a checkpoint saved after an optimizer step, {anyway}"
            )
        path = self._path(input_dir)
        if not os.path.exists(path):
            raise ValueError(
                f"accel_gradsync: {where}, and this process's gradients of that window ({path}) are missing. "
                f"Copy the checkpoint whole, resume from a checkpoint saved after an optimizer step, {anyway}"
            )
        saved = torch.load(path, weights_only=True)
        adapters = [a for a in self.state.adapters.values() if a is not None]
        if adapters:  # model by model in bind order, as they were saved
            for adapter, grads in zip(adapters, saved, strict=True):
                adapter.load_grad_state(grads)
            return
        # DDP binds at its first no_sync, which can come after the window's last micro-batch: put
        # them back into the models accelerate hands this hook.
        for model, grads in zip(models, saved, strict=True):
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = None if grad is None else grad.to(p.device)

    def _path(self, directory: str) -> str:
        return os.path.join(directory, f"accel_gradsync_grads_rank{self.state.accelerator.process_index}.pt")


class CheckpointHooks:
    """What one `attach()` saves and loads with a checkpoint: a window's gradients, `auto`'s plans
    (plan_checkpoint.py) and, for FSDP1, the sharded optimizer state (compat/optimizer_state.py)."""

    def __init__(self, state: Attachment) -> None:
        self.gradients = GradCheckpoint(state)
        self.plans = PlanCheckpoint(state)
        self.optimizer_state = OptimizerStateFix(state.accelerator, state.trainer)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def register(self) -> None:
        """accelerate's `save_state`/`load_state` pre-hooks, in the order they must run."""
        accelerator = self.gradients.state.accelerator
        self._handles += [
            accelerator.register_save_state_pre_hook(self.gradients.on_save_state),
            accelerator.register_load_state_pre_hook(self.gradients.on_load_state),
            accelerator.register_load_state_pre_hook(self.optimizer_state.on_load_state),
            accelerator.register_save_state_pre_hook(self.plans.on_save_state),
            accelerator.register_load_state_pre_hook(self.plans.on_load_state),
        ]

    def on_trainer_save(self, checkpoint: str) -> None:
        """A Trainer wrote `checkpoint` (it saves without `save_state`)."""
        self.plans.on_trainer_save(checkpoint)

    def after_trainer_load(self) -> None:
        """What the load pre-hooks do, for a Trainer, which loads without `load_state`."""
        self.optimizer_state.after_trainer_load()
        self.plans.after_trainer_load()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
