"""A `transformers.Trainer` resumed with `resume_from_checkpoint` ends with the uninterrupted run's
parameter shards and optimizer state, bit for bit, on this rank. Under FSDP1 with a sharded state
dict accelerate's loader leaves the optimizer empty and the plugin loads it again at train begin
(`OptimizerStateFix.after_trainer_load`); a resume without that would go on with fresh Adam state.

`run_trainer` runs in the launch of workers/resume.py (the same FSDP1 processes): TinyNet with a
loss, AdamW and a linear schedule, M micro-batches per step, a checkpoint every 2 steps; once
uninterrupted, once from another seed resumed from the first run's checkpoint-2. The Trainer uses
the state `enable_cpu_fsdp()` configured (`use_configured_state`), as the GRPO recipe's does.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from common import TinyNet, make_data
from torch import nn
from transformers import Trainer, TrainingArguments

import accel_gradsync

M, STEPS, SAVE_STEPS, B = 3, 4, 2, 2


class Regression(nn.Module):
    """TinyNet (its `Block`s are the FSDP units) returning the loss a Trainer reads."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x, y):
        return {"loss": F.mse_loss(self.net(x), y)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.X, self.Y = make_data(n)

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.X[i], "y": self.Y[i]}


def _train(out_dir: str, seed: int, config: dict | None, world: int, resume_from: str | None = None):
    """One Trainer run; `config` None: without the plugin."""
    torch.manual_seed(seed)  # the resumed run starts from other weights: only the load can match
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=B,
        gradient_accumulation_steps=M,
        max_steps=STEPS,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        accelerator_config={"use_configured_state": True},
        resume_from_checkpoint=resume_from,  # where the plugin finds the checkpoint, as the recipe's --flag sets it
    )
    trainer = Trainer(model=Regression(), args=args, train_dataset=Pairs(STEPS * M * B * world))
    handle = accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(**config)) if config is not None else None
    trainer.train(resume_from_checkpoint=resume_from)
    wrapper = handle.stats()["wrapper"] if handle is not None else None
    if handle is not None:
        handle.detach()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, wrapper, losses


def run_trainer(spec: dict, root: str, snapshot, differences, world: int) -> dict:
    """The uninterrupted and the resumed Trainer's results, with the plugin attached with the
    spec's `config` (None: not attached, what the test tells apart); `snapshot(model, optimizer)`
    and `differences(got, want)` are resume.py's."""
    whole, resumed = os.path.join(root, spec["name"], "whole"), os.path.join(root, spec["name"], "resumed")
    trainer, wrapper, losses = _train(whole, 0, spec["config"], world)
    want = snapshot(trainer.model_wrapped, trainer.optimizer)
    checkpoint = os.path.join(whole, f"checkpoint-{SAVE_STEPS}")
    trainer, _, resumed_losses = _train(resumed, 1, spec["config"], world, resume_from=checkpoint)
    got = snapshot(trainer.model_wrapped, trainer.optimizer)
    return {
        "wrapper": wrapper,
        "state_entries": len(trainer.optimizer.optimizer.state),
        "losses": losses,
        "resumed_losses": resumed_losses,
        "resume_differs": differences(got, want),
        "files": sorted(os.listdir(checkpoint)),
    }
