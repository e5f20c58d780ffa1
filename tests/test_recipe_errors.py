"""recipes/grpo.py: bad input stops with a clear error before training, naming what to change,
and writes nothing to output_dir. Parsing runs in-process (fast); one run goes through the script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import grpo  # noqa: E402


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
    args = parse("--dataset_name", str(data), "--prompt_column", "question",
                 "--answer_column", "solution", "--output_dir", str(tmp_path / "out"))  # fmt: skip
    renamed = grpo.load_prompts(args[0])
    assert {"prompt", "answer"} <= set(renamed.column_names)


def test_the_script_exits_before_writing_anything(tmp_path):
    """The same dataset error through `python recipes/grpo.py`: non-zero exit, no output_dir."""
    data = _dataset_without_answer(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "recipes/grpo.py", "--dataset_name", str(data), "--output_dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "ValueError: --prompt_column 'prompt'" in proc.stderr and "Set --prompt_column" in proc.stderr
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
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
