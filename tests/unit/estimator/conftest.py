"""What the estimator's tests share: accelerate configs as keys (`fsdp`) and as a file (`good`),
Qwen2-7B's config, the environment without sync settings, and the CLI's one error line."""

import dataclasses

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

# Qwen2-7B's config.json, written out so no hub is needed.
QWEN2_7B = dict(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def accelerate_config_keys(version=2, mixed_precision="no", processes=2, replicate=1, **fsdp_config):
    config = {
        "distributed_type": "FSDP",
        "num_processes": processes,
        "mixed_precision": mixed_precision,
        "fsdp_config": {"fsdp_version": version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", **fsdp_config},
    }
    if replicate > 1:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": replicate,
            "parallelism_config_dp_shard_size": processes // replicate,
        }
    return config


@pytest.fixture(scope="session")
def fsdp():
    """`fsdp(version, mixed_precision, processes, replicate, **fsdp_config)`: an accelerate config's keys."""
    return accelerate_config_keys


@pytest.fixture(scope="session")
def qwen2_7b():
    return dict(QWEN2_7B)


@pytest.fixture
def good_text():
    """An FSDP2 accelerate config over 2 processes that the estimate accepts, as YAML."""
    return GOOD


@pytest.fixture
def clean_env(monkeypatch):
    for f in dataclasses.fields(GradSyncConfig):
        monkeypatch.delenv(ENV_PREFIX + f.name.upper(), raising=False)


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(GOOD)
    return str(path)


def _cli_error(capsys, *args: str) -> str:
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


@pytest.fixture(scope="session")
def cli_error():
    """`cli_error(capsys, *args)`: the one error line `accel-gradsync estimate ARGS` ends with, checked to exit 2."""
    return _cli_error
