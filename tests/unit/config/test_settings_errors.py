"""Bad input: every invalid setting fails when the config is built (before any model,
launch or step), with a message naming the setting, the value and what to do instead, whether
it comes from Python, the environment or the command line."""

import dataclasses

import pytest
from transformers import HfArgumentParser

from accel_gradsync import GradSyncConfig
from accel_gradsync.config.settings import ENV_PREFIX

FIELDS = [f.name for f in dataclasses.fields(GradSyncConfig)]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in FIELDS:
        monkeypatch.delenv(ENV_PREFIX + name.upper(), raising=False)


@pytest.mark.parametrize("mode", ["defered", "Deferred", "per-micro-batch", "none", ""])
def test_invalid_mode_names_lists_the_choices(mode):
    with pytest.raises(ValueError) as err:
        GradSyncConfig(sync_mode=mode)
    msg = str(err.value)
    assert f"GradSyncConfig.sync_mode={mode!r}" in msg
    assert "per_micro_batch, deferred, auto, budget, defer_all_reduce" in msg


def test_invalid_mode_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_SYNC_MODE", "fast")
    with pytest.raises(ValueError, match=r"ACCEL_GRADSYNC_SYNC_MODE='fast' is not a valid `sync_mode`; valid choices"):
        GradSyncConfig()


def test_invalid_mode_on_the_command_line_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses(["--grad-sync-mode", "defered"])
    err = capsys.readouterr().err
    assert "--grad-sync-mode" in err and "invalid choice: 'defered'" in err and "deferred" in err


@pytest.mark.parametrize("budget", ["-1GiB", "-0.5", "lots", "12GB", "1e9", "GiB", "1.5", "2"])
def test_negative_or_unparsable_memory_budget(budget):
    with pytest.raises(ValueError) as err:
        GradSyncConfig(sync_mode="budget", memory_budget=budget)
    msg = str(err.value)
    assert f"GradSyncConfig.memory_budget={budget!r}" in msg
    assert "GiB" in msg and ("between 0 and 1" in msg)  # what to write instead


def test_memory_budget_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_MEMORY_BUDGET", "-2GiB")
    with pytest.raises(ValueError, match=r"ACCEL_GRADSYNC_MEMORY_BUDGET='-2GiB' is not a memory size"):
        GradSyncConfig(sync_mode="budget")


def test_budget_mode_without_a_budget_says_how_to_set_one():
    with pytest.raises(ValueError, match=r"sync_mode='budget' needs a memory budget: set --grad-sync-memory-budget"):
        GradSyncConfig(sync_mode="budget")


@pytest.mark.parametrize("margin", [-0.1, 1, 1.5, "abc"])
def test_invalid_memory_margin(margin):
    with pytest.raises(ValueError, match=r"GradSyncConfig.memory_margin=.*use a fraction 0 <= margin < 1"):
        GradSyncConfig(sync_mode="auto", memory_margin=margin)


@pytest.mark.parametrize("dtype", ["fp16", "float32", "bfloat16"])
def test_invalid_reduce_dtype(dtype):
    with pytest.raises(ValueError, match=rf"GradSyncConfig.reduce_dtype='{dtype}'.*valid choices: auto, fp32, bf16"):
        GradSyncConfig(reduce_dtype=dtype)


def test_defer_and_a_different_mode_name_both_settings():
    with pytest.raises(ValueError) as err:
        GradSyncConfig(defer=True, sync_mode="budget", memory_budget="1GiB")
    msg = str(err.value)
    assert "GradSyncConfig.defer=True" in msg and "GradSyncConfig.sync_mode='budget'" in msg
    assert "Set only one of them" in msg


@pytest.mark.parametrize(
    "free",
    [
        "0.5",
        "-3GiB",
    ],
)
def test_free_memory_must_be_an_absolute_size_when_the_config_is_built(free):
    with pytest.raises(ValueError) as err:
        GradSyncConfig(sync_mode="auto", free_memory=free)
    msg = str(err.value)
    assert f"GradSyncConfig.free_memory={free!r}" in msg and "40GiB" in msg and "fraction" not in msg


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
