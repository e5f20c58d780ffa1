"""A run restarts by itself: `accelerate launch --max_restarts 1` with `--resume_from_checkpoint
auto`, one rank killed with SIGKILL, ends with the weights of a run nobody interrupted, bit for bit.

The kill comes from outside the script (`recipe_killer/sitecustomize.py`): mid-step, inside a
gradient reduce-scatter, or while the rank writes its part of a checkpoint (the folder then has
the main process's trainer_state.json but not this rank's RNG state, and must not be resumed
from), or, with --save_total_limit, the moment the main process has deleted an old checkpoint.
FSDP2, 2 gloo ranks on CPU, a saved tiny Qwen2 and a local GSM8K-shaped dataset.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import recipe_inputs
from launcher import REPO, recipe_launch

KILLER = Path(__file__).parent / "recipe_killer"
STEPS, SAVE_STEPS, MICRO_BATCHES = 6, 2, 4
# What the README prescribes for restarts: the c10d rendezvous, with a fresh store per attempt.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RESTARTING = (
    "accelerate launch --max_restarts 1 --rdzv_backend c10d --config_file accelerate_configs/fsdp2.yaml "
    "recipes/grpo.py --model_name_or_path {model} --dataset_name {folder} --prompt_column question "
    f"--max_steps {STEPS} --save_steps {SAVE_STEPS} --resume_from_checkpoint auto "
    "--max_completion_length 8 --logging_steps 1 --disable_tqdm true"
)
# Gradient reduce-scatters per step without deferral: one per FSDP unit (the decoder layers and
# the root) on each micro-batch.
PER_STEP = (recipe_inputs.DECODER_LAYERS + 1) * MICRO_BATCHES


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("inputs")
    return {"model": recipe_inputs.save_model(tmp / "model"), "folder": recipe_inputs.save_dataset_folder(tmp / "data")}


def launch(
    inputs: dict, out_dir: Path, kill_at: str | None = None, kill_rank: int = 1, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    argv = shlex.split(RESTARTING.format(**inputs))[2:] + ["--output_dir", str(out_dir), *extra]
    env = dict(RESTART_ENV)
    if kill_at is not None:
        env |= {
            "RECIPE_KILL_RANK": str(kill_rank),
            "RECIPE_KILL_AT": kill_at,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(KILLER), os.environ.get("PYTHONPATH")])),
        }
    cmd, env = recipe_launch(argv, env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("uninterrupted") / "output"
    launch(inputs, out_dir)
    return out_dir


def assert_restarted_and_equal(proc, out_dir: Path, uninterrupted: Path, resumed_from: int, inputs: dict) -> None:
    output = proc.stdout + proc.stderr
    assert "exitcode: -9" in output, "no rank was killed"  # the agent's report of the SIGKILL
    # The first attempt started fresh (auto, nothing saved yet); the restart resumed, once.
    assert output.count("Resuming from") == 1
    assert f"Resuming from {out_dir / f'checkpoint-{resumed_from}'}." in output
    final = (out_dir / "model.safetensors").read_bytes()
    assert final == (uninterrupted / "model.safetensors").read_bytes()
    assert final != (inputs["model"] / "model.safetensors").read_bytes()  # it did train


def test_a_rank_killed_mid_step_restarts_from_the_last_checkpoint_and_ends_as_if_uninterrupted(
    inputs, uninterrupted, tmp_path
):
    kill_step = 5  # after checkpoint-4, half-way through the step's micro-batches
    out_dir = tmp_path / "output"
    proc = launch(inputs, out_dir, kill_at=f"reduce_scatter:{(kill_step - 1) * PER_STEP + PER_STEP // 2}")
    assert_restarted_and_equal(proc, out_dir, uninterrupted, resumed_from=4, inputs=inputs)


@pytest.mark.slow
def test_a_checkpoint_cut_short_by_a_kill_is_not_resumed_from(inputs, uninterrupted, tmp_path):
    """Rank 1 dies writing its RNG state into checkpoint-4, after rank 0 has begun its own part:
    the restart resumes from checkpoint-2, the newest whole one."""
    out_dir = tmp_path / "output"
    proc = launch(inputs, out_dir, kill_at="save:checkpoint-4/rng_state_1.pth")
    assert_restarted_and_equal(proc, out_dir, uninterrupted, resumed_from=2, inputs=inputs)


@pytest.mark.slow
def test_a_kill_right_after_an_old_checkpoint_is_deleted_resumes_from_the_new_one(inputs, uninterrupted, tmp_path):
    """With --save_total_limit 1, saving checkpoint-4 deletes checkpoint-2. The main process is
    killed the moment that deletion returns: checkpoint-4 must already be marked complete, or
    nothing is left to resume from and the restart silently trains from step 0."""
    out_dir = tmp_path / "output"
    proc = launch(inputs, out_dir, kill_at="rmtree:checkpoint-2", kill_rank=0, extra=("--save_total_limit", "1"))
    assert_restarted_and_equal(proc, out_dir, uninterrupted, resumed_from=4, inputs=inputs)
    assert sorted(p.name for p in out_dir.glob("checkpoint-*")) == [f"checkpoint-{STEPS}"]  # the limit holds
