"""A memory budget given without a mode selects budget mode, as --defer-grad-sync
selects deferred; with another mode given explicitly the budget is ignored with one warning."""

import dataclasses
import warnings

import pytest
from transformers import HfArgumentParser

from accel_gradsync import ENV_PREFIX, GradSyncConfig, GradSyncWarning


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for f in dataclasses.fields(GradSyncConfig):
        monkeypatch.delenv(ENV_PREFIX + f.name.upper(), raising=False)


def _quiet(**kwargs) -> GradSyncConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradSyncWarning)  # selecting budget must not also say "ignored"
        return GradSyncConfig(**kwargs)


def test_a_budget_alone_selects_budget_mode():
    assert _quiet(memory_budget="200KiB").mode == "budget"
    assert _quiet(memory_budget="0.25", free_memory="40GiB").mode == "budget"


def test_a_budget_from_the_environment_selects_budget_mode(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_MEMORY_BUDGET", "200KiB")
    assert _quiet().mode == "budget"


def test_a_budget_flag_selects_budget_mode():
    (config,) = HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses(["--grad-sync-memory-budget", "200KiB"])
    assert config.mode == "budget"


def test_an_empty_budget_selects_nothing(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_MEMORY_BUDGET", "")
    assert GradSyncConfig().mode == "per_micro_batch"


@pytest.mark.parametrize(
    "explicit, mode",
    [
        ({"sync_mode": "per_micro_batch"}, "per_micro_batch"),
        ({"sync_mode": "auto"}, "auto"),
        ({"defer": True}, "deferred"),
        ({"defer": "1"}, "deferred"),
    ],
)
def test_an_explicit_mode_keeps_the_budget_ignored_with_one_warning(explicit, mode):
    with pytest.warns(GradSyncWarning, match=r"memory_budget='200KiB' is ignored in sync mode") as record:
        config = GradSyncConfig(memory_budget="200KiB", **explicit)
    assert config.mode == mode
    assert len([w for w in record if "memory_budget" in str(w.message)]) == 1


def test_an_explicit_mode_from_the_environment_also_wins(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_SYNC_MODE", "deferred")
    with pytest.warns(GradSyncWarning, match="memory_budget"):
        assert GradSyncConfig(memory_budget="200KiB").mode == "deferred"


def test_help_says_a_budget_alone_selects_budget_mode():
    (field,) = [f for f in dataclasses.fields(GradSyncConfig) if f.name == "memory_budget"]
    assert "selects budget mode" in field.metadata["help"]
