"""Gradients of a window in progress, saved with and restored from accelerate's checkpoints.

accelerate's `save_state` holds no gradients, which is right at an optimizer step but loses the
micro-batches of a window saved mid-way, held ones included. Its save/load pre-hooks let each
rank write its gradients (wherever the wrapper keeps them) next to the checkpoint and put them
back when it is loaded, so a resumed run finishes the window exactly. accelerate runs the load
hooks once FSDP's models and optimizers are loaded; loading parameters leaves gradients alone
either way.

Whether the checkpoint holds a window, and for how many processes, is one note the main process
writes (`accel_gradsync_window.json`): every rank reads the same note, so every rank takes the
same decision. Each rank's gradients are its shards, so a window saved by another number of
processes is refused on every rank (a rank that loaded its shards while another found none would
then issue different collectives and hang the run). Where the wrapper cannot give them back
(FSDP1), the save warns and the note makes `load_state` refuse the checkpoint rather than resume
without those micro-batches.
"""

from __future__ import annotations

import json
import os

import torch

from accel_gradsync.runtime.state import Attachment

WINDOW_NOTE = "accel_gradsync_window.json"
"""The main process's note of a mid-window checkpoint: the window, the processes, the gradients."""


def writes_shared_files(state: Attachment) -> bool:
    """This process writes a checkpoint's shared files: the main process, or each node's first one
    where checkpoints are saved on each node (accelerate's `save_on_each_node`, the Trainer's
    `should_save`), as accelerate and the Trainer write their own."""
    if state.trainer is not None:
        return bool(state.trainer.args.should_save)
    accelerator = state.accelerator
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


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
        writes = writes_shared_files(state)
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
