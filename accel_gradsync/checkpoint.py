"""Gradients of a window in progress, saved with and restored from accelerate's checkpoints.

accelerate's `save_state` holds no gradients, which is right at an optimizer step but loses the
micro-batches of a window saved mid-way, held ones included. Its save/load pre-hooks let this
rank write its gradients (wherever the wrapper keeps them) next to the checkpoint and put them
back when it is loaded, so a resumed run finishes the window exactly. accelerate runs the load
hooks once FSDP's models and optimizers are loaded; loading parameters leaves gradients alone
either way. Where the wrapper
cannot give them back (FSDP1), the save warns and leaves a note that makes `load_state` refuse
the checkpoint rather than resume without those micro-batches.
"""

from __future__ import annotations

import json
import os

import torch

from .state import Attachment


class GradCheckpoint:
    """accelerate's save/load pre-hooks for one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state

    def on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        """Mid-window, save this rank's (held or sharded) gradients next to the checkpoint."""
        path, lost = self._path(output_dir), self._lost_path(output_dir)
        done = max((b.account.current.micro_batches for b in self.state.bound.values()), default=0)
        grads = [a.grad_state() for a in self.state.adapters.values() if a is not None] if done else []
        for stale in (path, lost):
            if os.path.exists(stale):
                os.remove(stale)  # a checkpoint over an older mid-window one
        if done and all(g is not None for g in grads):
            torch.save(grads, path)
            return
        if done:
            with open(lost, "w") as f:
                json.dump({"micro_batches": done, "of": self.state.micro_batches_per_step}, f)
            self.state.warn_once(
                "save_state",
                f"accel_gradsync: save_state() after {done} of {self.state.micro_batches_per_step} micro-batches "
                "of an accumulation window: accelerate's checkpoint holds no gradients and FSDP1's cannot be put "
                "back, so load_state will refuse this checkpoint rather than resume without those micro-batches. "
                "Save after the optimizer step (when accelerator.sync_gradients is True) for an exact resume.",
            )

    def on_load_state(self, models: list, input_dir: str) -> None:
        lost = self._lost_path(input_dir)
        if os.path.exists(lost):
            with open(lost) as f:
                window = json.load(f)
            raise ValueError(
                f"accel_gradsync: {input_dir} was saved after {window['micro_batches']} of {window['of']} "
                "micro-batches of an accumulation window, whose gradients this wrapper (FSDP1) cannot save, "
                "so resuming from it would lose them. Resume from a checkpoint saved after an optimizer "
                f"step, or delete {lost} to resume anyway without those micro-batches."
            )
        path = self._path(input_dir)
        if not os.path.exists(path):
            return
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

    def _lost_path(self, directory: str) -> str:
        """The note a mid-window save leaves where it cannot save the window's gradients."""
        return os.path.join(directory, f"accel_gradsync_window_lost_rank{self.state.accelerator.process_index}.json")
