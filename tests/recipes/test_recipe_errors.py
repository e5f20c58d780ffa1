"""recipes/grpo.py and its checks (recipes/grpo_inputs.py): bad input stops with a clear error
before training, naming what to change, and writes nothing to output_dir. Parsing runs in-process
(fast); one run goes through the script. Also what the recipe reads from its input without
refusing it: the number in an answer, which the accuracy reward compares as a number. What the
recipe takes from the package is tested with it: `check_launch` in tests/unit/test_launch.py,
which checkpoint to resume from in tests/unit/runtime/faults/test_resume_checkpoints.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

import embedded  # noqa: E402
import grpo  # noqa: E402
import grpo_inputs  # noqa: E402

from accel_gradsync.runtime.faults import resume  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """GRPOConfig sets up accelerate's process-wide state while it is parsed; don't leak it."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCEL_GRADSYNC_DEFER", raising=False)
    # `run` sets the recipe's save_on_signal default in the environment: given back after the test
    # (set, then deleted, so monkeypatch records it), not inherited by later tests' launches.
    monkeypatch.setenv("ACCEL_GRADSYNC_SAVE_ON_SIGNAL", "")
    monkeypatch.delenv("ACCEL_GRADSYNC_SAVE_ON_SIGNAL")
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
        grpo_inputs.resolve_rewards(["accuracy", "lenght"])


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
    renamed = grpo_inputs.load_prompts(args[0])
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


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# Input the script refuses: its arguments (files made in the test's tmp folder) and the one line it ends with.
BAD_INPUTS = {
    "malformed-config": (
        lambda tmp: ["--config", _write(tmp / "recipe.yaml", "learning_rate: [1.0e-3\nnum_generations: 4\n")],
        r"^error: --config \S+recipe\.yaml: not valid YAML \(line 2, column 16: expected ',' or ']'",
    ),
    "missing-config": (
        lambda tmp: ["--config", str(tmp / "missing.yaml")],
        r"^error: --config \S+missing\.yaml: cannot read it \(No such file or directory\)\.",
    ),
    "empty-jsonl": (
        lambda tmp: ["--dataset_name", _write(tmp / "data.jsonl", "")],
        r"^error: --dataset_name \S+data\.jsonl: the file is empty; .*one row per prompt",
    ),
    "blank-jsonl": (
        lambda tmp: ["--dataset_name", _write(tmp / "data.jsonl", "\n\n")],
        r"^error: --dataset_name \S+data\.jsonl: the file is empty",
    ),
    "broken-jsonl": (
        lambda tmp: ["--dataset_name", _write(tmp / "data.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')],
        r"^error: --dataset_name \S+data\.jsonl: datasets cannot read it as a \.jsonl file \(",
    ),
    "missing-data-file": (
        lambda tmp: ["--dataset_name", str(tmp / "gone.jsonl")],
        r"^error: --dataset_name \S+gone\.jsonl: no such file\.",
    ),
    "no-steps": (
        lambda tmp: ["--max_steps", "0"],
        r"^error: --max_steps 0: must be >= 1 \(optimizer steps\), or -1 to train for --num_train_epochs",
    ),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_ends_the_script_with_one_error_line(name, tmp_path, capsys):
    """The script's own path (`run`), in this process: exit 2 and one `error:` line, where any
    other exception (a traceback) fails the test; nothing is written to output_dir."""
    make_args, message = BAD_INPUTS[name]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        grpo.run([*make_args(tmp_path), "--output_dir", str(out)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
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
        grpo_inputs.check_save_steps_used(args[1], grpo.RECIPE_DEFAULTS["save_steps"])
    assert len(record) == 1


def test_a_parse_error_is_one_line_and_a_pointer_to_help(tmp_path):
    with pytest.raises(grpo_inputs.ParseError, match=r"--grad-sync-mode.*invalid choice: 'nonsense'"):
        parse("--grad-sync-mode", "nonsense", "--output_dir", str(tmp_path / "out"))


def test_a_sync_mode_the_launch_cannot_run_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """The recipe asks `accel_gradsync.check_launch` with its parsed settings; the message names the
    flags that selected the mode (tests/unit/test_launch.py has every case)."""
    args = parse("--grad-sync-memory-budget", "1GiB", "--output_dir", str(tmp_path / "out"))
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # after parsing, which would form a process group of WORLD_SIZE
    with pytest.raises(
        ValueError,
        match=r"^--grad-sync-mode budget \(or --grad-sync-memory-budget 1GiB, which selects it\): sync mode "
        r"'budget' needs FSDP2 \(per-unit requires_gradient_sync\), but the model is wrapped in fsdp1\.",
    ):
        grpo.main(*args)
    assert not (tmp_path / "out").exists()


def test_a_restart_the_launcher_cannot_carry_out_ends_the_script_before_parsing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(SystemExit) as exit_info:
        grpo.run(["--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: accelerate launch --max_restarts 2: "), errors
    assert not (tmp_path / "out").exists()


def test_the_trainer_leaves_rotation_to_the_recipe(tmp_path):
    """transformers would rotate inside its save, before the new checkpoint is marked complete."""
    training_args = parse("--save_total_limit", "3", "--output_dir", str(tmp_path / "out"))[1]
    assert resume.take_over_rotation(training_args) == 3
    assert training_args.save_total_limit is None


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


# -- the accuracy reward: a decimal is not the integer after its point, a minus sign binds to its
# number only, and thousands separators (GSM8K writes `1,000`) group digits rather than split them.


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("2.5", Fraction(5, 2)),
        ("so it is 0.30.", Fraction(3, 10)),
        ("The answer is 72.", 72),
        ("-12", -12),
        ("x = (-4)", -4),
        ("10-3", 3),  # a minus between two numbers is an operator, not the sign of the last
        ("1,000", 1000),
        ("$1,234,567.25", Fraction(123456725, 100)),
        ("12,34", 34),  # not a thousands grouping: two numbers
        ("1,2345", 2345),
        ("He has 3 + 4 = 7 apples.\n#### 7", 7),
        ("no number", None),
        ("", None),
    ],
)
def test_last_number_reads_decimals_signs_and_thousands_separators(text, number):
    assert embedded.last_number(text) == number


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("2.5", "5", 0.0),  # the integer after the point is not the answer
        ("5.0", "5", 1.0),  # equal as numbers
        ("0.5", "#### 0.50", 1.0),
        ("12", "12.5", 0.0),
        ("-7", "#### -7", 1.0),
        ("7", "#### -7", 0.0),
        ("1,000", "so 10 x 100 = 1000\n#### 1000", 1.0),
        ("$1,234.50", "#### 1,234.5", 1.0),
        ("1,234.50", "#### 50", 0.0),
        ("x", "5", 0.0),
        ("5", "no number here", 0.0),
    ],
)
def test_accuracy_reward_compares_numbers(completion, answer, reward):
    assert embedded.accuracy_reward([completion], [answer]) == [reward]


def test_accuracy_reward_reads_conversational_completions():
    completion = [{"role": "assistant", "content": "It costs 2,500."}]
    assert embedded.accuracy_reward([completion, completion], ["#### 2500", "#### 25"]) == [1.0, 0.0]
