"""`decide_residency`: forced by the setting, else decided from the bytes by budget and auto only."""

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.config.settings import ENV_PREFIX
from accel_gradsync.planning.residency import decide_residency, frozen_residency_under_vllm, frozen_units_to_keep

MiB = 2**20


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (
        "SYNC_MODE",
        "DEFER",
        "MEMORY_BUDGET",
        "KEEP_REFERENCE_UNSHARDED",
        "KEEP_FROZEN_UNSHARDED",
        "MEMORY_MARGIN",
    ):
        monkeypatch.delenv(ENV_PREFIX + name, raising=False)


def never() -> int:
    raise AssertionError("free memory read where nothing plans from it")


@pytest.mark.parametrize("mode", ["per_micro_batch", "deferred", "budget", "auto", "defer_all_reduce"])
def test_the_setting_forces_it_in_every_mode_without_reading_memory(mode):
    budget = {"memory_budget": "1MiB"} if mode == "budget" else {}
    for value, expected in (("true", True), ("false", False)):
        settings = GradSyncConfig(sync_mode=mode, keep_reference_unsharded=value, **budget).resolved()
        assert decide_residency(settings, 10 * MiB, never).resident is expected


@pytest.mark.parametrize("mode", ["per_micro_batch", "deferred", "defer_all_reduce"])
def test_auto_leaves_it_off_where_the_mode_plans_no_memory(mode):
    residency = decide_residency(GradSyncConfig(sync_mode=mode).resolved(), MiB, never)
    assert not residency.resident
    assert residency.reason == (  # a suggestion: what to set to have it
        f"sync mode {mode} does not plan memory; set keep_reference_unsharded=true to keep it unsharded "
        "for the run (~1.0 MiB per rank, no all-gather after step 1)"
    )


def test_budget_keeps_it_where_its_bytes_fit_the_budget_less_other_resident_models():
    settings = GradSyncConfig(memory_budget="8MiB").resolved()
    assert decide_residency(settings, 8 * MiB, never).resident
    assert not decide_residency(settings, 8 * MiB + 1, never).resident
    assert not decide_residency(settings, 5 * MiB, never, taken=4 * MiB).resident
    fraction = GradSyncConfig(memory_budget="0.5").resolved()  # half of what free memory says
    assert decide_residency(fraction, 5 * MiB, lambda: 10 * MiB).resident
    assert not decide_residency(fraction, 5 * MiB + 1, lambda: 10 * MiB).resident


def test_auto_keeps_it_where_its_bytes_fit_free_memory_less_the_margin():
    settings = GradSyncConfig(sync_mode="auto", memory_margin=0.25).resolved()
    assert decide_residency(settings, 75 * MiB, lambda: 100 * MiB).resident
    residency = decide_residency(settings, 75 * MiB + 1, lambda: 100 * MiB)
    assert not residency.resident
    assert residency.reason == (
        "its ~75.0 MiB unsharded params per rank do not fit the 75.0 MiB of auto's free memory less the margin"
    )


@pytest.mark.parametrize(
    ("value", "mode", "expected"),
    [
        ("true", "per_micro_batch", [True, True, True]),  # forced, whatever the mode
        ("false", "budget", [False, False, False]),
        ("auto", "per_micro_batch", [False, False, False]),  # a mode that plans no memory
        ("auto", "deferred", [False, False, False]),
        ("auto", "budget", [True, True, False]),  # 100 B: 60 fits, 30 of the 40 left, 20 of the 10 not
        # The window holds every unit through the step already: it keeps them all, reading no memory.
        ("auto", "windowed", [True, True, True]),
        ("false", "windowed", [False, False, False]),
    ],
)
def test_frozen_units_kept_in_order_while_they_fit_the_budget(value, mode, expected):
    budget = {"memory_budget": "100B"} if mode == "budget" else {}
    window = {"sync_mode": "deferred", "keep_params_unsharded": True} if mode == "windowed" else {"sync_mode": mode}
    settings = GradSyncConfig(keep_frozen_unsharded=value, **window, **budget).resolved()
    assert frozen_units_to_keep(settings, [60, 30, 20], never) == expected


def test_frozen_units_count_what_resident_reference_models_take_first():
    settings = GradSyncConfig(sync_mode="budget", memory_budget="100B").resolved()
    assert frozen_units_to_keep(settings, [60, 30, 20], never, taken=50) == [False, True, True]
    auto = GradSyncConfig(sync_mode="auto", memory_margin=0.5).resolved()  # half of 200 B free
    assert frozen_units_to_keep(auto, [60, 30, 20], lambda: 200) == [True, True, False]


def test_under_vllm_true_is_refused_and_auto_keeps_nothing_even_with_room():
    """TRL's use_vllm merges the adapter into the sharded base between steps: what attach and the
    estimate both apply before deciding which frozen units to keep."""
    with pytest.raises(ValueError, match=r"use_vllm=true: .* set keep_frozen_unsharded=false"):
        frozen_residency_under_vllm(GradSyncConfig(keep_frozen_unsharded="true").resolved())
    for value in ("auto", "false"):
        settings = GradSyncConfig(sync_mode="budget", memory_budget="100B", keep_frozen_unsharded=value).resolved()
        under = frozen_residency_under_vllm(settings)
        assert under.keep_frozen_unsharded is False and under.sync_mode == "budget", value
        assert frozen_units_to_keep(under, [60, 30, 20], never) == [False, False, False]
    without = GradSyncConfig(sync_mode="budget", memory_budget="100B").resolved()
    assert frozen_units_to_keep(without, [60, 30, 20], never) == [True, True, False]  # without vLLM: what fits
