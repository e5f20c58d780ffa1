"""A run restarts by itself: `accelerate launch --max_restarts 1` with `--resume_from_checkpoint
auto`, one rank killed with SIGKILL, ends with the weights of a run nobody interrupted, bit for bit.

The kill comes from outside the script (`recipe_killer/sitecustomize.py`): mid-step, inside a
gradient reduce-scatter, or while the rank writes its part of a checkpoint (the folder then has
the main process's trainer_state.json but not this rank's RNG state, and must not be resumed
from), or, with --save_total_limit, the moment the main process has deleted an old checkpoint.
FSDP2, 2 gloo ranks on CPU, a saved tiny Qwen2 and a local GSM8K-shaped dataset, with GRPO's
reference model (beta 0.04) kept unsharded for the whole run (`keep_reference_unsharded`).

A preempted run loses nothing: the scheduler's warning signal (RECIPE_KILL_SIGNAL: sent by a rank
to its launcher, as Kubernetes and SLURM signal the launcher, or to the rank alone) mid-window of
step 3 makes every rank finish that step, save a complete checkpoint-3 and exit with
`PREEMPTED_EXIT_CODE`, without a restart by the agent; the same command resumes from checkpoint-3
(no step recomputed) and ends with the weights, optimizer, scheduler and RNG states of the
uninterrupted run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import recipe_inputs
from launcher import REPO, recipe_launch

from accel_gradsync import PREEMPTED_EXIT_CODE
from tools.chaos import compare_checkpoints

KILLER = Path(__file__).parent / "recipe_killer"
STEPS, SAVE_STEPS, MICRO_BATCHES = 6, 2, 4
# What the README prescribes for restarts: the c10d rendezvous, with a fresh store per attempt.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RESTARTING = (
    "accelerate launch --max_restarts {restarts} --rdzv_backend c10d --config_file accelerate_configs/fsdp2.yaml "
    "recipes/grpo.py --model_name_or_path {model} --dataset_name {folder} --prompt_column question "
    f"--max_steps {STEPS} --save_steps {SAVE_STEPS} --resume_from_checkpoint auto "
    "--max_completion_length 8 --logging_steps 1 --disable_tqdm true"
    # GRPO's reference model, kept unsharded for the run: saved around and resumed with, bit for bit.
    " --beta 0.04 --grad-sync-keep-reference-unsharded true"
)
# Gradient reduce-scatters per step without deferral: one per FSDP unit (the decoder layers and
# the root) on each micro-batch.
PER_STEP = (recipe_inputs.DECODER_LAYERS + 1) * MICRO_BATCHES


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("inputs")
    return {"model": recipe_inputs.save_model(tmp / "model"), "folder": recipe_inputs.save_dataset_folder(tmp / "data")}


def launch(
    inputs: dict,
    out_dir: Path,
    kill_at: str | None = None,
    kill_rank: int = 1,
    extra: tuple[str, ...] = (),
    signal: str | None = None,
    to: str = "launcher",
    restarts: int = 1,
    finishes: bool = True,
) -> subprocess.CompletedProcess:
    """The restarting launch; with `kill_at`, rank `kill_rank` is killed there, or with `signal`
    sends that signal there (to its launcher, or to itself with `to="rank"`)."""
    argv = shlex.split(RESTARTING.format(restarts=restarts, **inputs))[2:] + ["--output_dir", str(out_dir), *extra]
    env = dict(RESTART_ENV)
    if kill_at is not None:
        env |= {
            "RECIPE_KILL_RANK": str(kill_rank),
            "RECIPE_KILL_AT": kill_at,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(KILLER), os.environ.get("PYTHONPATH")])),
        }
        env |= {"RECIPE_KILL_SIGNAL": signal, "RECIPE_KILL_SIGNAL_TO": to} if signal is not None else {}
    cmd, env = recipe_launch(argv, env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if finishes:
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


@pytest.mark.slow  # the default suite restarts after a kill in the SIGTERM case's resumed launch, below
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


# -- preemption ------------------------------------------------------------------------------------
PREEMPTED_AT = 3
MID_STEP_3 = f"reduce_scatter:{(PREEMPTED_AT - 1) * PER_STEP + PER_STEP // 2}"


def assert_preempted(proc: subprocess.CompletedProcess, out_dir: Path, step: int, signal: str = "SIGTERM") -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, "the launch ended as if training had finished"
    line = f"accel_gradsync: {signal}: saved checkpoint-{step} in {out_dir}; exiting with code {PREEMPTED_EXIT_CODE}"
    assert line in output, output[-8000:]
    assert "Resuming from" not in output, "the agent spent a restart on the preemption"
    assert (out_dir / f"checkpoint-{step}" / "checkpoint_complete.json").is_file()
    assert not list(out_dir.glob(f"checkpoint-{step + 1}*"))  # it stopped at that step
    assert not (out_dir / "model.safetensors").exists()  # no final save: training has not ended


def assert_resumed_and_equal(
    out_dir: Path, uninterrupted: Path, inputs: dict, step: int, restarts: int = 1, killed_in: int | None = None
) -> None:
    """The same command resumes from checkpoint-`step` and ends as the uninterrupted run; with
    `killed_in`, rank 1 of that launch is killed half-way through that step and the agent restarts
    the group from the newest checkpoint before it."""
    kill = (
        {} if killed_in is None else {"kill_at": f"reduce_scatter:{(killed_in - 1 - step) * PER_STEP + PER_STEP // 2}"}
    )
    proc = launch(inputs, out_dir, restarts=restarts, **kill)
    output = proc.stdout + proc.stderr
    assert f"Resuming from {out_dir / f'checkpoint-{step}'}." in output  # no step recomputed
    if killed_in is not None:
        restarted_from = (killed_in - 1) // SAVE_STEPS * SAVE_STEPS
        assert "exitcode: -9" in output and output.count("Resuming from") == 2, output[-8000:]
        assert f"Resuming from {out_dir / f'checkpoint-{restarted_from}'}." in output
    assert (out_dir / "model.safetensors").read_bytes() == (uninterrupted / "model.safetensors").read_bytes()
    last = f"checkpoint-{STEPS}"
    assert compare_checkpoints(uninterrupted / last, out_dir / last) == []  # weights, optimizer, scheduler, RNG


@pytest.mark.compat  # the elastic agent's and accelerate launch's handling of the signal differ by release
def test_sigterm_to_the_launcher_mid_window_saves_that_step_exits_and_resumes_as_if_uninterrupted(
    inputs, uninterrupted, tmp_path
):
    out_dir = tmp_path / "output"
    # transformers' own JIT checkpoint on SIGTERM as well: the plugin's acts alone, saying so once per rank.
    jit = ("--enable_jit_checkpoint", "true")
    proc = launch(inputs, out_dir, kill_at=MID_STEP_3, signal="SIGTERM", finishes=False, extra=jit)
    assert_preempted(proc, out_dir, PREEMPTED_AT)  # one checkpoint, at the same step on every rank
    assert "then none: kept unsharded for the whole run" in proc.stdout  # the reference model, resident
    assert (proc.stdout + proc.stderr).count("enable_jit_checkpoint and save_on_signal='SIGTERM'") == 2
    assert not list(out_dir.rglob("checkpoint-is-incomplete.txt"))  # transformers' JIT save never started
    # The agent got it, shut its workers down and re-raised it (restarting nothing): accelerate up to
    # 1.15 lets the exception end the launch, 1.16 exits 128 + 15 with it.
    assert "Received 15 death signal, shutting down workers" in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 143 or "SignalException: Process" in proc.stderr, (proc.returncode, proc.stderr[-4000:])
    # The resumed launch also restarts by itself after a rank dies (mid-step 5, after checkpoint-4).
    assert_resumed_and_equal(out_dir, uninterrupted, inputs, PREEMPTED_AT, killed_in=5)


@pytest.mark.slow
def test_sigusr1_when_configured_reaches_the_ranks_alone_and_each_exits_with_the_code(inputs, uninterrupted, tmp_path):
    """SIGUSR1 to rank 1 only: rank 0 learns of it at the step's agreement, both save checkpoint-3
    and exit 75, which the agent, with no restarts to spend, reports for each rank."""
    out_dir = tmp_path / "output"
    extra = ("--grad-sync-save-on-signal", "SIGUSR1")
    proc = launch(inputs, out_dir, MID_STEP_3, extra=extra, signal="SIGUSR1", to="rank", restarts=0, finishes=False)
    assert_preempted(proc, out_dir, PREEMPTED_AT, signal="SIGUSR1")
    output = proc.stdout + proc.stderr
    assert output.count(f"exitcode  : {PREEMPTED_EXIT_CODE}") == 2, output[-6000:]  # torch elastic's report
    assert_resumed_and_equal(out_dir, uninterrupted, inputs, PREEMPTED_AT, restarts=0)


@pytest.mark.slow
def test_sigterm_while_a_checkpoint_is_written_stops_right_after_it(inputs, uninterrupted, tmp_path):
    """The signal arrives while rank 1 writes its part of checkpoint-2: that save completes and
    is the one resumed from."""
    out_dir = tmp_path / "output"
    proc = launch(inputs, out_dir, kill_at="save:checkpoint-2/rng_state_1.pth", signal="SIGTERM", finishes=False)
    assert_preempted(proc, out_dir, 2)
    assert_resumed_and_equal(out_dir, uninterrupted, inputs, 2)


@pytest.mark.slow
def test_sigterm_twice_saves_once_and_resumes_as_if_uninterrupted(inputs, uninterrupted, tmp_path):
    """Two SIGTERMs to rank 1 itself, one mid-window and one in the same step: one checkpoint, one exit."""
    out_dir = tmp_path / "output"
    second = (
        f"reduce_scatter:{(PREEMPTED_AT - 1) * PER_STEP + PER_STEP // 2},{(PREEMPTED_AT - 1) * PER_STEP + PER_STEP - 1}"
    )
    proc = launch(inputs, out_dir, kill_at=second, signal="SIGTERM", to="rank", finishes=False)
    assert_preempted(proc, out_dir, PREEMPTED_AT)
    assert_resumed_and_equal(out_dir, uninterrupted, inputs, PREEMPTED_AT)
