"""Bad input to `accelerate launch ... recipes/grpo.py` on 2 CPU ranks: the launch stops before the
model is loaded and before output_dir exists, with one line naming the setting, printed once
(by the main process; the other rank is stopped by the launcher), never argparse's whole usage
or a traceback on every rank.

What a shell sees: the main process exits 2, and `accelerate launch` (torch elastic underneath)
reports that as its own exit code 1, after its failure summary (a launcher traceback ending in
`ChildFailedError`, whose root cause names rank 0 and `exitcode  : 2`)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from launcher import REPO, recipe_launch

FSDP2 = "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py"
FSDP1 = "accelerate launch --config_file accelerate_configs/fsdp1.yaml recipes/grpo.py"

CASES = {
    "zero-micro-batches": (
        f"{FSDP2} --gradient_accumulation_steps 0",
        ["error: --gradient_accumulation_steps 0: must be >= 1 (micro-batches per optimizer step)."],
    ),
    "budget-on-fsdp1": (
        f"{FSDP1} --grad-sync-mode budget --grad-sync-memory-budget 1GiB",
        [
            "error: --grad-sync-mode budget (or --grad-sync-memory-budget 1GiB, which selects it): sync mode "
            "'budget' needs FSDP2 (per-unit requires_gradient_sync), but the model is wrapped in fsdp1."
        ],
    ),
    "defer-all-reduce-on-fsdp1": (
        f"{FSDP1} --grad-sync-mode defer_all_reduce",
        [
            "error: --grad-sync-mode defer_all_reduce: sync mode 'defer_all_reduce' needs FSDP2 "
            "(set_requires_all_reduce), but the model is wrapped in fsdp1."
        ],
    ),
    "defer-all-reduce-without-hsdp": (
        f"{FSDP2} --grad-sync-mode defer_all_reduce",
        ["error: --grad-sync-mode defer_all_reduce: sync mode 'defer_all_reduce' needs an HSDP mesh"],
    ),
    "empty-dataset": (  # read on every rank, by datasets, before anything is built
        f"{FSDP2} --dataset_name {{tmp}}/empty.jsonl",
        ["error: --dataset_name {tmp}/empty.jsonl: the file is empty; give a .jsonl file with one row per prompt"],
    ),
    "unknown-mode": (
        f"{FSDP2} --grad-sync-mode nonsense",
        [
            "invalid choice: 'nonsense' (choose from 'per_micro_batch', 'deferred', 'auto', 'budget', "
            "'defer_all_reduce')",
            "See `python recipes/grpo.py --help` for every setting.",
        ],
    ),
}


QUICK = ("budget-on-fsdp1",)  # the default suite; every case with --slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in CASES])
def test_bad_input_stops_the_launch_with_one_line_before_anything_is_written(name, tmp_path):
    command, lines = CASES[name]
    (tmp_path / "empty.jsonl").write_text("")
    out_dir = tmp_path / "output"
    output = launch_refused(command.format(tmp=tmp_path), out_dir)
    for line in lines:
        assert output.count(line.format(tmp=tmp_path)) == 1, output[-4000:]
    assert not out_dir.exists()


def launch_refused(command: str, out_dir: Path) -> str:
    """Launch `command` (from `accelerate launch` on) and check that it ended as a refused setting
    does: the launcher's exit code 1 for the main process's exit 2, no traceback from the recipe
    (the launcher's own is its failure summary), no usage, no model built; return the output."""
    cmd, env = recipe_launch([*shlex.split(command)[2:], "--output_dir", str(out_dir)])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]  # what accelerate launch returns for any failed rank
    root_cause = output.split("Root Cause")[-1]
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause, output[-4000:]  # not a crash or signal
    assert output.count("Traceback (most recent call last)") == 1, output[-6000:]  # the launcher's summary only
    assert "usage:" not in output  # not argparse's 200 lines, once per rank
    assert "grad sync:" not in output  # attach never ran: no model was built
    return output


@pytest.mark.slow  # resolve_resume's refusal runs in-process in tests/recipes/test_recipe_errors.py
def test_resume_on_another_number_of_processes_is_refused_at_start(tmp_path):
    """A checkpoint written by 4 processes, resumed by `auto` on 2: refused before anything is built."""
    out_dir = tmp_path / "output"
    folder = out_dir / "checkpoint-4"
    folder.mkdir(parents=True)
    (folder / "checkpoint_complete.json").write_text(json.dumps({"global_step": 4, "world_size": 4}))
    output = launch_refused(f"{FSDP2} --resume_from_checkpoint auto", out_dir)
    line = (
        f"error: --resume_from_checkpoint auto: {folder} was written by 4 processes, this launch has 2. "
        "A checkpoint resumes on the number of processes that wrote it"
    )
    assert output.count(line) == 1, output[-4000:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["checkpoint-4"]  # nothing written


@pytest.mark.slow  # check_launch's own tests refuse it in-process (tests/unit/test_launch.py)
def test_max_restarts_with_a_rendezvous_that_cannot_restart_is_refused_at_start(tmp_path):
    """accelerate's default rendezvous (static) shares the launcher's store across restarts, so a
    restarted group could not form: refused before training, by each attempt's main process."""
    out_dir = tmp_path / "output"
    cmd, env = recipe_launch(["--max_restarts", "1", *shlex.split(FSDP2)[2:], "--output_dir", str(out_dir)])
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = (
        "error: accelerate launch --max_restarts 1: a restarted group cannot form with the launcher's shared "
        "rendezvous store"
    )
    assert output.count(line) == 2, output[-4000:]  # the first attempt and the one restart
    assert not out_dir.exists()
