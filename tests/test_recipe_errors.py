"""recipes/grpo.py: bad input stops with a clear error before training, naming what to change,
and writes nothing to output_dir. Parsing runs in-process (fast); one run goes through the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import checkpoints  # noqa: E402
import checks  # noqa: E402
import grpo  # noqa: E402

from accel_gradsync import GradSyncConfig  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """GRPOConfig sets up accelerate's process-wide state while it is parsed; don't leak it."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCEL_GRADSYNC_DEFER", raising=False)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def parse(*args: str):
    return grpo.parse_args(grpo.make_parser(), list(args))


def test_defaults_and_plugin_flag_parse(tmp_path):
    script_args, training_args, model_args, grad_sync = parse("--output_dir", str(tmp_path / "out"))
    assert model_args.model_name_or_path is None and script_args.dataset_name is None  # the embedded run
    assert training_args.gradient_accumulation_steps == grpo.RECIPE_DEFAULTS["gradient_accumulation_steps"]
    assert training_args.num_generations == grpo.RECIPE_DEFAULTS["num_generations"]
    assert grad_sync.defer is False
    assert parse("--defer-grad-sync", "--output_dir", str(tmp_path / "out"))[3].defer is True


def test_plugin_field_is_a_yaml_key(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("defer: true\n")
    assert parse("--config", str(config), "--output_dir", str(tmp_path / "out"))[3].defer is True


def test_real_model_recipe_yaml_keys_are_all_fields(tmp_path):
    # bf16 needs a GPU; every other key must be a field the parser knows.
    script_args, training_args, model_args, grad_sync = parse(
        "--config", str(REPO / "recipes/qwen2.5-0.5b-gsm8k.yaml"), "--bf16", "false", "--output_dir", str(tmp_path)
    )
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert script_args.prompt_column == "question" and grad_sync.defer is True


def test_unknown_flag_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(ValueError, match=r"command line: '--defer-grad-sink' \(did you mean --defer-grad-sync"):
        parse("--defer-grad-sink", "--output_dir", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_unknown_yaml_key_is_named_with_a_suggestion(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("num_generation: 4\nlearning_rate: 1.0e-3\n")
    with pytest.raises(ValueError, match=r"--config YAML: 'num_generation' \(did you mean num_generations"):
        parse("--config", str(config), "--output_dir", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_num_generations_not_dividing_the_generation_batch(tmp_path):
    # Single process: generation batch = 4 per device x 1 process x 4 steps = 16.
    with pytest.raises(ValueError, match=r"num_generations \(3\).*set --num_generations to a divisor"):
        parse("--num_generations", "3", "--output_dir", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_unknown_reward_function_lists_the_choices():
    with pytest.raises(ValueError, match=r"--reward_funcs.*'lenght'.*valid choices: accuracy, format"):
        grpo.resolve_rewards(["accuracy", "lenght"])


def _dataset_without_answer(tmp_path: Path) -> Path:
    from datasets import Dataset

    path = tmp_path / "data"
    Dataset.from_dict({"question": ["1+1="], "solution": ["2"]}).save_to_disk(str(path))
    return path


def test_dataset_without_the_needed_column(tmp_path):
    data = _dataset_without_answer(tmp_path)
    args = parse("--dataset_name", str(data), "--prompt_column", "question", "--output_dir", str(tmp_path / "out"))
    with pytest.raises(
        ValueError, match=r"--answer_column 'answer'.*has no column.*question, solution.*Set --answer_column"
    ):
        grpo.main(*args)
    assert not (tmp_path / "out").exists()
    # Naming the right columns fixes it.
    args = parse(
        "--dataset_name",
        str(data),
        "--prompt_column",
        "question",
        "--answer_column",
        "solution",
        "--output_dir",
        str(tmp_path / "out"),
    )
    renamed = grpo.load_prompts(args[0])
    assert {"prompt", "answer"} <= set(renamed.column_names)


def test_the_script_exits_before_writing_anything(tmp_path):
    """The same dataset error through `python recipes/grpo.py`: non-zero exit, no output_dir."""
    data = _dataset_without_answer(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "recipes/grpo.py", "--dataset_name", str(data), "--output_dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("error: --prompt_column 'prompt'") == 1 and "Set --prompt_column" in proc.stderr
    assert "Traceback" not in proc.stderr  # one line, not a stack
    assert not out.exists()


def test_negative_warm_up_steps_are_refused_before_anything_is_built(tmp_path):
    script_args, training_args, model_args, grad_sync_args = parse(
        "--sft_warmup_steps", "-5", "--output_dir", str(tmp_path / "out")
    )
    with pytest.raises(ValueError, match=r"--sft_warmup_steps -5: must be >= 0"):
        grpo.main(script_args, training_args, model_args, grad_sync_args)
    assert not (tmp_path / "out").exists()


def test_the_warm_up_gives_the_tiny_model_the_format_deterministically():
    import embedded
    import torch
    from transformers import set_seed

    models = []
    for _ in range(2):  # every rank builds and warms up its own copy: they must be identical
        set_seed(42)
        tokenizer = embedded.build_tokenizer()
        model = embedded.build_model(tokenizer)
        loss = embedded.warm_up(model, tokenizer, steps=60)
        models.append(model)
    assert loss < 1.6  # from about 3 (random over 17 tokens)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_zero_gradient_accumulation_steps_is_refused_before_anything_is_built(tmp_path):
    args = parse("--gradient_accumulation_steps", "0", "--output_dir", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"^--gradient_accumulation_steps 0: must be >= 1 \(micro-batches"):
        grpo.main(*args)
    assert not (tmp_path / "out").exists()


def test_save_steps_alone_selects_saving_every_n_steps(tmp_path):
    training_args = parse("--save_steps", "7", "--output_dir", str(tmp_path / "out"))[1]
    assert (training_args.save_strategy.value, training_args.save_steps) == ("steps", 7)


def test_save_steps_that_the_strategy_ignores_get_one_warning(tmp_path):
    args = parse("--save_steps", "7", "--save_strategy", "no", "--output_dir", str(tmp_path / "out"))
    with pytest.warns(UserWarning, match=r"--save_steps 7 is ignored with --save_strategy no") as record:
        checks.check_save_steps_used(args[1], grpo.RECIPE_DEFAULTS["save_steps"])
    assert len(record) == 1


def test_a_parse_error_is_one_line_and_a_pointer_to_help(tmp_path):
    with pytest.raises(checks.ParseError, match=r"--grad-sync-mode.*invalid choice: 'nonsense'"):
        parse("--grad-sync-mode", "nonsense", "--output_dir", str(tmp_path / "out"))


@pytest.mark.parametrize(
    ("env", "mode", "error"),
    [
        (
            {"FSDP_VERSION": "1"},
            "budget",
            r"--grad-sync-mode budget.*needs FSDP2 .*, but the model is wrapped in fsdp1",
        ),
        ({"FSDP_VERSION": "1"}, "defer_all_reduce", r"needs FSDP2 .*, but the model is wrapped in fsdp1"),
        ({"FSDP_VERSION": "2"}, "defer_all_reduce", r"needs an HSDP mesh.*sharded over a 1-D mesh"),
        (
            {
                "FSDP_VERSION": "2",
                "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
            },
            "defer_all_reduce",
            None,
        ),
        ({"FSDP_VERSION": "2"}, "budget", None),
        ({"FSDP_VERSION": "1"}, "deferred", None),
    ],
)
def test_sync_modes_the_launch_cannot_run_are_refused_from_its_environment(monkeypatch, env, mode, error):
    """What `accelerate launch --config_file ...` exports decides, before any model exists."""
    for name, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)
    config = GradSyncConfig(sync_mode=mode, memory_budget="1GiB" if mode == "budget" else None)
    if error is None:
        checks.check_sync_mode_fits_launch(config)
    else:
        with pytest.raises(ValueError, match=error):
            checks.check_sync_mode_fits_launch(config)


def test_keep_params_unsharded_on_fsdp1_is_not_refused(monkeypatch):
    for name, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", "FSDP_VERSION": "1"}.items():
        monkeypatch.setenv(name, value)
    checks.check_sync_mode_fits_launch(GradSyncConfig(defer=True, keep_params_unsharded=True))  # the plugin warns


def test_restart_with_the_launchers_shared_store_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(
        ValueError, match=r"--max_restarts 1: .*--rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    ):
        checks.check_restart_settings()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    checks.check_restart_settings()


def _checkpoint(output_dir: Path, step: int, complete: bool, marker_step: int | None = None) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        marker = {"global_step": step if marker_step is None else marker_step, "world_size": 2}
        (folder / checkpoints.COMPLETE_MARKER).write_text(json.dumps(marker))
    return folder


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    assert checkpoints.resolve_resume("auto", str(tmp_path / "none")) is None  # no output_dir yet: start fresh
    assert checkpoints.resolve_resume("auto", str(tmp_path)) is None  # no checkpoint: start fresh
    _checkpoint(tmp_path, 9, complete=True)
    newest = _checkpoint(tmp_path, 10, complete=True)
    _checkpoint(tmp_path, 20, complete=False)  # killed while saving: trainer_state.json but no mark
    _checkpoint(tmp_path, 30, complete=True, marker_step=20)  # a mark copied from elsewhere
    (tmp_path / "checkpoint-40").mkdir()  # killed before anything was written
    (tmp_path / "checkpoint-50").mkdir()
    (tmp_path / "checkpoint-50" / checkpoints.COMPLETE_MARKER).write_text('{"global_st')  # cut short
    assert checkpoints.resolve_resume("auto", str(tmp_path)) == str(newest)  # 10 > 9 numerically, not as text


def test_resume_from_a_missing_folder_is_refused_before_anything_is_built(tmp_path):
    args = parse("--resume_from_checkpoint", str(tmp_path / "gone"), "--output_dir", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint .*gone: no such folder.*'auto'"):
        grpo.main(*args)
    assert not (tmp_path / "out").exists()


def test_resume_auto_is_explained_in_help():
    help_text = grpo.make_parser().format_help()
    assert "'auto': the newest complete checkpoint" in " ".join(help_text.split())


def test_warm_up_steps_with_a_model_path_get_one_warning(tmp_path):
    args = parse(
        "--model_name_or_path",
        str(tmp_path / "model"),
        "--sft_warmup_steps",
        "5",
        "--output_dir",
        str(tmp_path / "out"),
    )
    with pytest.warns(UserWarning, match=r"--sft_warmup_steps 5 is ignored with --model_name_or_path") as record:
        grpo.prepare(*args)
    assert len([w for w in record if "sft_warmup_steps" in str(w.message)]) == 1
    assert not (tmp_path / "out").exists()
