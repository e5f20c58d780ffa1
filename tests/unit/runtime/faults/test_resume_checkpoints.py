"""accel_gradsync/runtime/faults/resume.py in a single process: which checkpoint `--resume_from_checkpoint`
resolves to, what rotation keeps, and the mark `MarkCheckpointComplete` writes after a save.
(Named apart from tests/distributed/test_resume.py: pytest imports test files by base name.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import TrainerState

from accel_gradsync.runtime.faults import resume


def _checkpoint(output_dir: Path, step: int, complete: bool, marker_step: int | None = None) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        marker = {"global_step": step if marker_step is None else marker_step, "world_size": 2}
        (folder / resume.COMPLETE_MARKER).write_text(json.dumps(marker))
    return folder


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    assert resume.resolve_resume("auto", str(tmp_path / "none"), world_size=2) is None  # no output_dir yet: fresh
    assert resume.resolve_resume("auto", str(tmp_path), world_size=2) is None  # no checkpoint: start fresh
    _checkpoint(tmp_path, 9, complete=True)
    newest = _checkpoint(tmp_path, 10, complete=True)
    _checkpoint(tmp_path, 20, complete=False)  # killed while saving: trainer_state.json but no mark
    _checkpoint(tmp_path, 30, complete=True, marker_step=20)  # a mark copied from elsewhere
    (tmp_path / "checkpoint-40").mkdir()  # killed before anything was written
    (tmp_path / "checkpoint-50").mkdir()
    (tmp_path / "checkpoint-50" / resume.COMPLETE_MARKER).write_text('{"global_st')  # cut short
    assert resume.resolve_resume("auto", str(tmp_path), world_size=2) == str(newest)  # 10 > 9 numerically
    assert resume.resolve_resume(None, str(tmp_path), world_size=2) is None
    assert resume.resolve_resume("", str(tmp_path), world_size=2) is None


def test_resume_on_another_number_of_processes_is_refused(tmp_path):
    """Each rank's RNG state is saved per process and the batch of an optimizer step scales with
    the processes: a checkpoint resumes on the number of processes that wrote it."""
    folder = _checkpoint(tmp_path, 10, complete=True)  # written by 2 processes
    for value in ("auto", str(folder)):
        with pytest.raises(
            ValueError,
            match=rf"^--resume_from_checkpoint {re.escape(value)}: {re.escape(str(folder))} was written by 2 "
            r"processes, this launch has 4\..*accelerate launch --num_processes 2.*another --output_dir",
        ):
            resume.resolve_resume(value, str(tmp_path), world_size=4)
    assert resume.resolve_resume("auto", str(tmp_path), world_size=2) == str(folder)
    unmarked = tmp_path / "elsewhere" / "checkpoint-3"  # a checkpoint from another tool: nothing to compare
    unmarked.mkdir(parents=True)
    assert resume.resolve_resume(str(unmarked), str(tmp_path), world_size=4) == str(unmarked)


def test_resume_from_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^--resume_from_checkpoint \S+gone: no such folder.*'auto'"):
        resume.resolve_resume(str(tmp_path / "gone"), str(tmp_path), world_size=2)


def _names(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    """What --save_total_limit keeps, counted in complete checkpoints: a folder a kill cut short is
    no checkpoint to keep, and folders past the step just saved belong to another run's future."""
    for step, complete in ((2, True), (3, False), (4, True), (6, True), (8, False), (10, True)):
        _checkpoint(tmp_path, step, complete=complete)
    resume.rotate_checkpoints(str(tmp_path), save_total_limit=2, saved_step=6)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-6", "checkpoint-8", "checkpoint-10"]
    resume.rotate_checkpoints(str(tmp_path), save_total_limit=None, saved_step=10)  # no limit
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-6", "checkpoint-8", "checkpoint-10"]
    best = str(tmp_path / "checkpoint-4")  # load_best_model_at_end keeps the best one too
    resume.rotate_checkpoints(str(tmp_path), save_total_limit=1, saved_step=10, best=best)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-10"]


@pytest.fixture
def accelerator(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_save_is_marked_complete_then_old_checkpoints_are_deleted(tmp_path, accelerator):
    _checkpoint(tmp_path, 2, complete=True)
    saved = _checkpoint(tmp_path, 4, complete=False)  # what the Trainer's save just wrote
    callback = resume.MarkCheckpointComplete(accelerator, save_total_limit=1)
    callback.on_save(SimpleNamespace(output_dir=str(tmp_path)), TrainerState(global_step=4), control=None)
    assert json.loads((saved / resume.COMPLETE_MARKER).read_text()) == {"global_step": 4, "world_size": 1}
    assert not (saved / (resume.COMPLETE_MARKER + ".tmp")).exists()
    assert _names(tmp_path) == ["checkpoint-4"]
    assert resume.resolve_resume("auto", str(tmp_path), world_size=1) == str(saved)


def test_take_over_rotation_leaves_the_trainer_every_checkpoint():
    args = SimpleNamespace(save_total_limit=3)
    assert resume.take_over_rotation(args) == 3 and args.save_total_limit is None
