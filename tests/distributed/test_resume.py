"""Resuming reproduces the uninterrupted run bit for bit: parameters and optimizer state (AdamW's
moments and step counts, on every rank) after the same micro-batches, on 2 gloo ranks.

A plain `accumulate` loop (workers/resume.py) saves with `accelerator.save_state` at a window
boundary or in the middle of a window and resumes with `load_state`, in each sync mode: on FSDP2
with a sharded and with a full state dict, on FSDP1 with `SHARDED_STATE_DICT` (the config where
accelerate's own loader comes back with an empty optimizer, accel_gradsync/compat/optimizer_state.py)
and on DDP, one launch per wrapper; the FSDP1 launch also resumes a `transformers.Trainer`
(workers/trainer_resume.py), where the plugin loads the optimizer again at train begin. With
--slow: a checkpoint resumed on 4 processes, and the GRPO recipe saving with `--save_strategy
steps` and resuming with `--resume_from_checkpoint` on FSDP1 (two recipe launches per mode).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from launcher import REPO, accelerate_config, launch, recipe_launch

from accel_gradsync.compat.optimizer_state import trainer_checkpoint

M, L = 3, 9  # three windows of three micro-batches
BOUNDARY, MIDDLE = 2, 4  # save after micro-batch 2 (ends window 1) or after 4 (inside window 2)
SHARDED = {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}
PMB, DEFERRED = {"config": {}}, {"config": {"defer": True}}
AUTO = {"config": {"sync_mode": "auto", "free_memory": "64GiB"}}  # measures step 1, then holds everything
FSDP2_MODES = {
    "per_micro_batch": PMB,
    "deferred": DEFERRED,
    "budget": {"config": {"sync_mode": "budget", "memory_budget": "1100B"}},  # holds both Blocks, not the head
    "windowed": {"config": {"defer": True, "keep_params_unsharded": True}},
    "auto": AUTO,
}
# A played device whose peak changes from step to step: 9 kB below the margin; step 1 peaks at
# 6 kB, which leaves 3 kB (not enough to hold every unit windowed), step 2 over the margin, so auto
# falls back before step 3. A resumed run that measured step 1 again, planned from another peak or
# kept step 1's plan for step 2 ends with other levels and other peaks.
PROBE = {"capacity": 10_000, "by_step": [6_000, 9_500]}
AUTO_PROBE = {"config": {"sync_mode": "auto"}, "probe": PROBE}
FSDP1_MODES = {"per_micro_batch": PMB, "deferred": DEFERRED, "auto": AUTO}
DDP_MODES = {"per_micro_batch": PMB, "deferred": DEFERRED}


WHERE = {"boundary": BOUNDARY, "middle": MIDDLE}


def _specs(modes: dict, suffix: str = "", **keys) -> list[dict]:
    return [
        {"name": f"{mode}_{where}{suffix}", **spec, "M": M, "L": L, "save_at": at, **keys}
        for mode, spec in modes.items()
        for where, at in WHERE.items()
    ]


def _launch(config: dict | None, specs: list[dict], *args: str) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(specs, f)
        f.flush()
        return launch("resume", ["--specs", f.name, *args], config)


@pytest.fixture(scope="module")
def fsdp2(compat_only):
    """One FSDP2 launch for every FSDP2 spec: each mode saved with a sharded and with a full state
    dict (one uninterrupted run per mode for both), and auto on the played device, with and without
    its plan. Names: `<mode>_<where>`, `<mode>_<where>_full`, `auto_probe_<where>[_without_plan]`."""
    sharded = _specs(FSDP2_MODES, state_dict_type="SHARDED_STATE_DICT")
    if compat_only:  # the compat test reads these alone
        return _launch(accelerate_config("fsdp2", **SHARDED), sharded)
    full = _specs(FSDP2_MODES, "_full", state_dict_type="FULL_STATE_DICT")  # accelerate_configs/fsdp2.yaml's
    probe = _specs({"auto_probe": AUTO_PROBE}, state_dict_type="SHARDED_STATE_DICT")
    without_plan = _specs({"auto_probe": AUTO_PROBE}, "_without_plan", state_dict_type="SHARDED_STATE_DICT")
    without_plan = [{**spec, "drop_plan": True} for spec in without_plan]
    return _launch(accelerate_config("fsdp2", **SHARDED), sharded + full + probe + without_plan)


# A transformers Trainer resumed in the FSDP1 launch, after the loop's specs: with the plugin
# (deferred, the mode of the recipe's FSDP1 quick-start command) and without it.
TRAINER = {"trainer": True, "state_dict_type": "SHARDED_STATE_DICT"}
TRAINER_SPECS = [
    {"name": "trainer_deferred", **TRAINER, "config": {"defer": True}},
    {"name": "trainer_without_plugin", **TRAINER, "config": None},
]


@pytest.fixture(scope="module")
def fsdp1():
    specs = _specs(FSDP1_MODES, state_dict_type="SHARDED_STATE_DICT") + TRAINER_SPECS
    return _launch(accelerate_config("fsdp1", **SHARDED), specs)


@pytest.fixture(scope="module")
def ddp():
    return _launch(None, _specs(DDP_MODES))


def _assert_exact(run: dict) -> None:
    assert run["state_entries"] > 0, run  # AdamW has state on this rank to lose
    assert run["resumed_levels"] == run["levels"], run  # each unit's level at the last step
    assert run["state_entries_after_load"] == run["state_entries"], run
    assert run["resume_differs"] == [], run  # every parameter shard and optimizer tensor, bitwise
    assert run["save_and_continue_differs"] == [], run  # saving disturbs nothing


@pytest.mark.compat
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("mode", list(FSDP2_MODES))
def test_fsdp2_resume_equals_uninterrupted_run(fsdp2, mode, where):
    for rank in fsdp2:
        run = rank[f"{mode}_{where}"]
        assert run["wrapper"] == "fsdp2"
        _assert_exact(run)
        assert not run["save_warnings"], run
        assert {f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0"} <= set(run["files"]), run  # sharded, as DCP
        if mode == "auto":  # the resumed run goes on with the plan, it does not measure step 1 again
            assert run["levels"] == [3, 0, 0], run
            assert "accel_gradsync_plan.json" in run["files"], run


@pytest.mark.parametrize("where", list(WHERE))
def test_auto_resumed_goes_on_with_the_plan_and_the_peaks_of_the_uninterrupted_run(fsdp2, where):
    for rank in fsdp2:
        run = rank[f"auto_probe_{where}"]
        assert run["auto"] == {"measured_peaks": PROBE["by_step"], "plan_changes": 1}, run  # it fell back
        _assert_exact(run)
        assert run["resumed_auto"] == run["auto"], run
        assert "accel_gradsync_plan.json" in run["files"], run


@pytest.mark.parametrize("where", list(WHERE))
def test_auto_resumed_without_its_plan_ends_elsewhere(fsdp2, where):
    """What the test above tells apart: a resume that measures step 1 again takes step 3's peak
    for step 1's, plans from it and ends with other levels."""
    for rank in fsdp2:
        run = rank[f"auto_probe_{where}_without_plan"]
        assert run["resumed_auto"]["measured_peaks"] != PROBE["by_step"], run
        assert run["resumed_levels"] != run["levels"], run


@pytest.mark.slow  # launches 2 then 4 processes
def test_auto_checkpoint_resumed_on_another_number_of_processes_is_one_decision(tmp_path):
    """A 2-process auto run's checkpoints resumed on 4 processes: every rank decides from what the
    main process saved. From a step boundary, auto measures its first step again on every rank;
    from the middle of a window, whose gradients were saved per rank, every rank refuses. Ranks
    that decided differently would issue different collectives and wait for ever: past a deadline
    the workers exit and the launch fails instead of hanging."""
    specs = [
        {"name": where, **AUTO, "M": M, "L": L, "save_at": at, "dir": str(tmp_path / where)}
        for where, at in WHERE.items()
    ]
    saved = _launch(accelerate_config("fsdp2", **SHARDED), [{**spec, "only": "save"} for spec in specs])
    four = accelerate_config("fsdp2", num_processes=4, **SHARDED)
    resumed = _launch(four, [{**spec, "only": "load"} for spec in specs], "--deadline", "420")
    assert len(resumed) == 4 and "accel_gradsync_plan.json" in saved[0]["boundary"]["files"]
    for rank in resumed:
        boundary = rank["boundary"]
        assert [w for w in boundary["load_warnings"] if "2 processes" in w and "4 processes" in w], boundary
        assert len(boundary["auto"]["measured_peaks"]) == 1, boundary  # steps 2 and 3 here: step 2 measured
        assert boundary["auto"] == resumed[0]["boundary"]["auto"] and boundary["levels"] == [3, 0, 0], boundary
        error = rank["middle"].get("load_error", "")
        assert "2 processes" in error and "4 processes" in error, rank["middle"]


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("mode", list(FSDP2_MODES))
def test_fsdp2_resume_with_a_full_state_dict_equals_uninterrupted_run(fsdp2, mode, where):
    for rank in fsdp2:
        run = rank[f"{mode}_{where}_full"]
        assert run["wrapper"] == "fsdp2"
        _assert_exact(run)
        assert not run["save_warnings"], run
        assert {f"{FSDP_MODEL_NAME}.bin", f"{OPTIMIZER_NAME}.bin"} <= set(run["files"]), run  # whole, by rank 0
        assert f"{OPTIMIZER_NAME}_0" not in run["files"], run


@pytest.mark.parametrize("mode", list(FSDP1_MODES))
def test_fsdp1_resume_from_a_step_boundary_restores_the_optimizer_state(fsdp1, mode):
    for rank in fsdp1:
        run = rank[f"{mode}_boundary"]
        assert run["wrapper"] == "fsdp1"
        _assert_exact(run)
        assert not run["save_warnings"], run
        assert not any(f.startswith(("accel_gradsync_grads", "accel_gradsync_windowed")) for f in run["files"]), run


@pytest.mark.parametrize("mode", list(FSDP1_MODES))
def test_fsdp1_mid_window_checkpoint_warns_at_save_and_is_refused_at_load(fsdp1, mode):
    for rank in fsdp1:
        run = rank[f"{mode}_middle"]
        assert run["save_and_continue_differs"] == [], run
        assert any("save_state() after 2 of 3 micro-batches" in w for w in run["save_warnings"]), run
        error = run.get("load_error", "")
        assert "saved after 2 of 3 micro-batches" in error and "accel_gradsync_window.json" in error, run


def test_a_trainer_resumed_on_fsdp1_ends_with_the_uninterrupted_runs_parameters_and_optimizer(fsdp1):
    """The Trainer loads its checkpoint itself: the plugin finds it and loads the optimizer again
    at train begin (workers/trainer_resume.py)."""
    for rank in fsdp1:
        run = rank["trainer_deferred"]
        assert run["wrapper"] == "fsdp1" and run["state_entries"] > 0, run
        assert {f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0"} <= set(run["files"]), run  # sharded, as DCP
        assert run["resume_differs"] == [], run  # every parameter shard and optimizer tensor, bitwise
        assert len(run["losses"]) == 4 and run["resumed_losses"] == run["losses"], run  # steps 3 and 4 too


def test_a_trainer_resumed_on_fsdp1_without_the_plugin_goes_on_with_a_fresh_optimizer(fsdp1):
    """What the test above tells apart: accelerate's loader alone resumes with no Adam state."""
    for rank in fsdp1:
        run = rank["trainer_without_plugin"]
        assert [n for n in run["resume_differs"] if n.startswith("optim/")], run


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("mode", list(DDP_MODES))
def test_ddp_resume_equals_uninterrupted_run(ddp, mode, where):
    for rank in ddp:
        run = rank[f"{mode}_{where}"]
        assert run["wrapper"] == "ddp"
        _assert_exact(run)
        assert not run["save_warnings"], run


# -- the Trainer: the GRPO recipe --------------------------------------------------------------
# The recipe's defaults but for a short run that checkpoints every 2 optimizer steps.
RECIPE = [
    "--config_file",
    "accelerate_configs/fsdp1.yaml",
    "recipes/grpo.py",
    "--max_completion_length",
    "4",
    "--max_steps",
    "4",
    "--save_strategy",
    "steps",
    "--save_steps",
    "2",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
]


def _recipe(output_dir: Path, *flags: str) -> list[float]:
    """Run the recipe on 2 ranks; the losses it logged (a resumed run's include the checkpoint's)."""
    cmd, env = recipe_launch([*RECIPE, "--output_dir", str(output_dir), *flags])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def _dcp(directory: Path) -> dict:
    """A DCP checkpoint's tensors and values by flattened key, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, path)
    return dict(_flatten(torch.load(path, weights_only=False)))


def _flatten(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}{index}.")
    else:
        yield prefix[:-1], value


def _differs(a: dict, b: dict) -> list[str]:
    def same(x, y) -> bool:
        return torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y

    return [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or not same(a[k], b[k])]


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "sync",
    [
        pytest.param([], id="per_micro_batch", marks=SLOW),
        pytest.param(["--defer-grad-sync"], id="deferred", marks=SLOW),
        pytest.param(["--grad-sync-mode", "auto", "--grad-sync-free-memory", "64GiB"], id="auto", marks=SLOW),
    ],
)
def test_recipe_resumed_on_fsdp1_ends_with_the_uninterrupted_runs_weights_and_optimizer(tmp_path, sync):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole_losses = _recipe(whole, *sync)
    resumed_losses = _recipe(resumed, *sync, "--resume_from_checkpoint", str(whole / "checkpoint-2"))
    want, got = whole / "checkpoint-4", resumed / "checkpoint-4"
    optimizer = _dcp(want / "optimizer_0")
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg") for k in optimizer)
    assert _differs(_dcp(got / "optimizer_0"), optimizer) == []
    assert _differs(_dcp(got / "pytorch_model_fsdp_0"), _dcp(want / "pytorch_model_fsdp_0")) == []
    assert len(whole_losses) == 4 and resumed_losses == whole_losses  # steps 3 and 4 too
    assert not list(whole.glob("*.safetensors")), "FSDP1 on CPU saves no model weights (README, CPU notes)"


def _checkpoint(path: Path, step: int, history: list) -> Path:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    return path


def test_the_checkpoint_a_trainer_resumed_from_is_the_one_whose_state_it_holds(tmp_path):
    history = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    state = SimpleNamespace(global_step=2, log_history=history)
    named = _checkpoint(tmp_path / "elsewhere" / "checkpoint-2", 2, history)
    last = _checkpoint(tmp_path / "out" / "checkpoint-2", 2, history)

    def trainer(resume_from_checkpoint):
        args = SimpleNamespace(resume_from_checkpoint=resume_from_checkpoint, output_dir=str(tmp_path / "out"))
        return SimpleNamespace(state=state, args=args)

    assert trainer_checkpoint(trainer(str(named))) == str(named)  # TrainingArguments.resume_from_checkpoint
    assert trainer_checkpoint(trainer(None)) == str(last)  # train(resume_from_checkpoint=True)'s pick
    other = _checkpoint(tmp_path / "other" / "checkpoint-2", 2, [{"step": 1, "loss": 0.7}])
    (last / "trainer_state.json").unlink()
    assert trainer_checkpoint(trainer(str(other))) is None  # another run's step 2: not this state
