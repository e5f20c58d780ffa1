"""Trainer checkpoints that are whole, kept and resumed from: `MarkCheckpointComplete` (a Trainer
callback) marks a `checkpoint-<step>` folder with `COMPLETE_MARKER` once every rank has written
it, then deletes old ones (`save_total_limit`, taken over with `take_over_rotation`: transformers
deletes inside its save, before the new one is whole); `resolve_resume` turns
`--resume_from_checkpoint` (a folder or `auto`) into the folder to resume from. A folder counts
as complete only through `is_complete`, so resuming and rotation agree on what is whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

AUTO = "auto"
COMPLETE_MARKER = "checkpoint_complete.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def take_over_rotation(training_args) -> int | None:
    """Return `save_total_limit` and set it to None, so that the Trainer keeps every checkpoint
    and `MarkCheckpointComplete(save_total_limit=...)` deletes the old ones once the new one is
    marked complete."""
    limit, training_args.save_total_limit = training_args.save_total_limit, None
    return limit


class MarkCheckpointComplete(TrainerCallback):
    """After each checkpoint save: wait for every rank, mark the folder complete, then delete the
    checkpoints beyond `save_total_limit` (None or <= 0: keep all, as in transformers).

    The Trainer's main process writes `trainer_state.json` last but does not wait for the other
    ranks, so a rank killed while writing its `rng_state_<rank>.pth` can leave a folder that looks
    whole; only the mark, written after a barrier, says it is. The mark records the number of
    processes too (`check_world_size`)."""

    def __init__(self, accelerator, save_total_limit: int | None = None) -> None:
        self.accelerator = accelerator
        self.save_total_limit = save_total_limit

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
            rotate_checkpoints(args.output_dir, self.save_total_limit, state.global_step, state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()  # no rank resumes training (and can be killed) before the mark


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, saved_step: int, best: str | None = None) -> None:
    """Keep the `save_total_limit` newest complete checkpoints up to `saved_step` (and `best`, the
    best model's folder with load_best_model_at_end); delete the other folders up to that step,
    a folder a kill cut short included. Folders past `saved_step` are left alone: they come from
    a run that went further before this one resumed from an older checkpoint."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    folders = [folder for step, folder in _checkpoint_folders(output_dir) if step <= saved_step]
    kept = set([folder for folder in folders if is_complete(folder)][-save_total_limit:])
    if best is not None:
        kept.add(os.path.normpath(best))
    for folder in folders:
        if folder not in kept:
            _delete(folder)


def _delete(folder: str) -> None:
    """The mark first: a folder deleted half-way must not look complete."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, COMPLETE_MARKER))
    shutil.rmtree(folder, ignore_errors=True)


def _checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every `checkpoint-<step>` folder of `output_dir`, by step."""
    if not os.path.isdir(output_dir):
        return []
    names = ((m, name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name)))
    return sorted((int(m.group(1)), os.path.normpath(os.path.join(output_dir, name))) for m, name in names)


def _mark(folder: str) -> dict | None:
    """The completion mark of `folder` when it is readable and names the folder's own step."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(folder)))
    try:
        with open(os.path.join(folder, COMPLETE_MARKER)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not (match and isinstance(record, dict) and record.get("global_step") == int(match.group(1))):
        return None
    return record


def is_complete(folder: str) -> bool:
    """True when `folder` carries a readable completion mark for its own step."""
    return _mark(folder) is not None


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The complete `checkpoint-<step>` folder of `output_dir` with the highest step, if any."""
    for _, folder in reversed(_checkpoint_folders(output_dir)):
        if is_complete(folder):
            return folder
    return None


def resolve_resume(value: str | None, output_dir: str, world_size: int) -> str | None:
    """`--resume_from_checkpoint`: None (start fresh), `auto` (the newest complete checkpoint in
    output_dir, else start fresh) or a checkpoint folder, which must exist. A marked checkpoint
    must have been written by `world_size` processes."""
    if value is None or value == "":
        return None
    if value == AUTO:
        folder = newest_complete_checkpoint(output_dir)
    elif not os.path.isdir(value):
        raise ValueError(
            f"--resume_from_checkpoint {value}: no such folder. Give a checkpoint-<step> folder, or "
            f"'{AUTO}' for the newest complete checkpoint in --output_dir ({output_dir}), if any."
        )
    else:
        folder = value
    if folder is not None:
        check_world_size(value, folder, world_size)
    return folder


def check_world_size(value: str, folder: str, world_size: int) -> None:
    """Refuse to resume on another number of processes than the checkpoint's: each rank's RNG
    state is saved per process (a new rank would find none and continue with other random
    numbers), and the batch of an optimizer step scales with the processes, so the resumed run
    would not continue the saved one. A folder without a mark (from another tool) is not checked."""
    saved = (_mark(folder) or {}).get("world_size")
    if saved is not None and saved != world_size:
        raise ValueError(
            f"--resume_from_checkpoint {value}: {folder} was written by {saved} processes, this launch has "
            f"{world_size}. A checkpoint resumes on the number of processes that wrote it (its RNG states are "
            f"per process, its batches per step scale with them): launch with accelerate launch "
            f"--num_processes {saved}, or start a new run in another --output_dir."
        )
