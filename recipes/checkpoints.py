"""Which checkpoint a run resumes from, and which checkpoints are whole.

The Trainer writes a checkpoint from every rank (model and optimizer shards, each rank's RNG
state) and the main process writes `trainer_state.json` last, but without waiting for the
other ranks: a rank killed while writing its `rng_state_<rank>.pth` can leave a folder whose
`trainer_state.json` is complete while its own file is cut short (transformers then fails to
load it, or skips a missing one and resumes with other random numbers). So once every rank has
returned from the save (`on_save`, after a barrier), the main process writes `COMPLETE_MARKER`
into the folder, atomically; `--resume_from_checkpoint auto` takes the newest folder that has it.
"""

from __future__ import annotations

import json
import os
import re

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

AUTO = "auto"
COMPLETE_MARKER = "checkpoint_complete.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class MarkCheckpointComplete(TrainerCallback):
    """After each checkpoint save: wait for every rank, then mark the folder complete."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    def on_save(self, args, state, control, **kwargs):
        self.accelerator.wait_for_everyone()  # every rank has returned from writing its files
        if self.accelerator.is_main_process:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            record = {"global_step": state.global_step, "world_size": self.accelerator.num_processes}
            staging = os.path.join(folder, COMPLETE_MARKER + ".tmp")
            with open(staging, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(staging, os.path.join(folder, COMPLETE_MARKER))
        self.accelerator.wait_for_everyone()  # no rank resumes training (and can be killed) before the mark


def is_complete(folder: str) -> bool:
    """True when `folder` carries a readable completion mark for its own step."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(folder)))
    try:
        with open(os.path.join(folder, COMPLETE_MARKER)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(match) and record.get("global_step") == int(match.group(1))


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The complete `checkpoint-<step>` folder of `output_dir` with the highest step, if any."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name)))
    for _, name in reversed(steps):
        folder = os.path.join(output_dir, name)
        if is_complete(folder):
            return folder
    return None


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`--resume_from_checkpoint`: None (start fresh), `auto` (the newest complete checkpoint in
    output_dir, else start fresh) or a checkpoint folder, which must exist."""
    if value is None or value == "":
        return None
    if value == AUTO:
        return newest_complete_checkpoint(output_dir)
    if not os.path.isdir(value):
        raise ValueError(
            f"--resume_from_checkpoint {value}: no such folder. Give a checkpoint-<step> folder, or "
            f"'{AUTO}' for the newest complete checkpoint in --output_dir ({output_dir}), if any."
        )
    return value
