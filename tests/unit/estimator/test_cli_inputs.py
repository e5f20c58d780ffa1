"""Every bad input to `accel-gradsync estimate` ends in one line naming the input and
what is wrong, exit code 2 and no traceback; negative sizes say they must be >= 0; defer accepts
the ints 0 and 1 as it accepts "0" and "1"."""

import dataclasses
import subprocess
import sys

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.config.settings import ENV_PREFIX
from accel_gradsync.estimator.cli import main

GOOD = """distributed_type: FSDP
num_processes: 2
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for f in dataclasses.fields(GradSyncConfig):
        monkeypatch.delenv(ENV_PREFIX + f.name.upper(), raising=False)


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(GOOD)
    return str(path)


def cli_error(capsys, *args: str) -> str:
    """The one error line `accel-gradsync estimate ARGS` ends with, checked to exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--micro-batches", "2", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("accel-gradsync estimate: error: "), err  # the message is that one line
    assert err.count("error:") == 1, err
    return last


def test_malformed_yaml_names_the_file_and_where(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: [unclosed\n")
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "not valid YAML" in line and "line 3" in line, line


def test_yaml_that_is_not_a_mapping_names_the_file(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- distributed_type\n- FSDP\n")
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "mapping" in line, line


def test_a_directory_is_not_reported_as_missing(tmp_path, capsys):
    line = cli_error(capsys, "--accelerate-config", str(tmp_path))
    assert str(tmp_path) in line and "is a directory" in line and "does not exist" not in line, line


@pytest.mark.parametrize("processes", ["0", "-2"])
def test_num_processes_below_one_is_refused(good, capsys, processes):
    line = cli_error(capsys, "--accelerate-config", good, "--num_processes", processes)
    assert f"--num_processes={processes}" in line and "at least 1" in line, line


def test_num_processes_below_one_in_the_file_is_refused(tmp_path, capsys):
    path = tmp_path / "zero.yaml"
    path.write_text(GOOD.replace("num_processes: 2", "num_processes: 0"))
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "num_processes=0" in line and "at least 1" in line, line


def test_a_model_directory_without_config_json(good, tmp_path, capsys):
    model = tmp_path / "my-model"
    model.mkdir()
    line = cli_error(capsys, "--accelerate-config", good, "--model", str(model))
    assert str(model) in line and "no config.json" in line and "model_type" not in line, line


@pytest.mark.parametrize("flag", ["--grad-sync-memory-budget", "--grad-sync-free-memory"])
@pytest.mark.parametrize("joined", [False, True])
def test_negative_sizes_on_the_command_line_must_be_at_least_zero(good, capsys, flag, joined):
    size = [f"{flag}=-1GiB"] if joined else [flag, "-1GiB"]  # argparse reads a lone -1GiB as an option
    line = cli_error(capsys, "--accelerate-config", good, *size)
    assert "='-1GiB'" in line and "must be >= 0" in line, line


@pytest.mark.parametrize("budget", ["-5", "-1GiB", "-0.5"])
def test_negative_budgets_must_be_at_least_zero(budget):
    with pytest.raises(ValueError, match=rf"GradSyncConfig.memory_budget='{budget}'.*must be >= 0"):
        GradSyncConfig(memory_budget=budget)


def test_defer_accepts_the_ints_0_and_1_only():
    assert GradSyncConfig(defer=1).defer is True and GradSyncConfig(defer=1).mode == "deferred"
    assert GradSyncConfig(defer=0).defer is False and GradSyncConfig(defer=0).mode == "per_micro_batch"
    for other in (2, -1, 1.0):
        with pytest.raises(ValueError, match=rf"GradSyncConfig.defer={other!r} is not a valid value for `defer`"):
            GradSyncConfig(defer=other)


def test_the_real_command_exits_2_with_one_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: [unclosed\n")
    out = subprocess.run(
        [sys.executable, "-m", "accel_gradsync", "estimate", "--accelerate-config", str(path), "--micro-batches", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.rstrip("\n").splitlines()[-1].startswith("accel-gradsync estimate: error: ")


def test_a_model_accelerate_cannot_wrap_names_the_layer_class_to_set(good, tmp_path, capsys):
    """A BERT under TRANSFORMER_BASED_WRAP without a layer class: accelerate wraps the model's
    `_no_split_modules` (its embeddings too) and `fully_shard` refuses the overlap. The line names
    the setting and the model's repeated layer class, and that setting then works."""
    from transformers import BertConfig, BertForMaskedLM

    model = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(model)  # random weights; the estimate reads config.json only
    line = cli_error(capsys, "--accelerate-config", good, "--model", str(model))
    assert "fsdp_transformer_layer_cls_to_wrap: BertLayer" in line, line
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(GOOD + "  fsdp_transformer_layer_cls_to_wrap: BertLayer\n")
    assert main(["estimate", "--micro-batches", "2", "--accelerate-config", str(fixed), "--model", str(model)]) == 0
    assert "2 micro-batches per optimizer step" in capsys.readouterr().out
