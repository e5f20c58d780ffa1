"""A memory budget given without a mode selects budget mode, as --defer-grad-sync
selects deferred; with another mode given explicitly the budget is ignored with one warning.
What budget and auto hold their gradients in by default (fp32 where the model computes in bf16),
as the estimate, the decision line and the warnings say it, on models sharded on the meta device.
(The gradients themselves, on real 2-rank runs: tests/distributed/test_bf16_precision.py.)"""

import dataclasses
import warnings

import pytest
from transformers import HfArgumentParser

from accel_gradsync import GradSyncConfig, GradSyncWarning
from accel_gradsync.config.settings import ENV_PREFIX
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.formatting import format_table
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.planning.policies import resolve_policy
from accel_gradsync.planning.reduce_dtype import reduce_dtype_for
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.core.decision import describe_decision, warn_about_plan


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


@pytest.mark.parametrize("variable", ["ACCEL_GRADSYNC_SYNC_MODE=deferred", "ACCEL_GRADSYNC_DEFER=1"])
def test_an_explicit_budget_outranks_a_mode_from_the_environment(monkeypatch, variable):
    name, value = variable.split("=")
    monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradSyncWarning)
        assert GradSyncConfig(memory_budget="200KiB").mode == "budget"


def test_a_budget_from_the_environment_gives_way_to_an_explicit_mode(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_MEMORY_BUDGET", "200KiB")
    with pytest.warns(GradSyncWarning, match="MEMORY_BUDGET"):
        assert GradSyncConfig(sync_mode="deferred").mode == "deferred"
    with pytest.warns(GradSyncWarning, match="MEMORY_BUDGET"):
        assert GradSyncConfig(defer=True).mode == "deferred"


def test_help_says_a_budget_alone_selects_budget_mode():
    (field,) = [f for f in dataclasses.fields(GradSyncConfig) if f.name == "memory_budget"]
    assert "selects budget mode" in field.metadata["help"]


# -- the dtype held gradients are summed in ------------------------------------------------------------
M = 4


def bf16_config(version: int) -> dict:
    fsdp = {"fsdp_version": version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    return {"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16", "fsdp_config": fsdp}


def _plan(config: GradSyncConfig, version: int = 2, mode: str | None = None):
    """The adapter a bf16 run of the recipe's model has for the config's mode (as attach writes
    its reduce dtype), and the plan the mode makes with 1 GiB free."""
    setup = read_accelerate_config(bf16_config(version))
    adapter = estimated_adapter(build_meta_model(load_model_config("recipe-default")), setup, config, mode)
    return adapter, resolve_policy(config.resolved()).plan(adapter, lambda: 2**30, M)


@pytest.mark.parametrize("mode", ["auto", "budget"])
def test_auto_and_budget_reduce_in_fp32_unless_bf16_is_chosen(mode):
    assert reduce_dtype_for(mode, "auto") == "fp32"
    assert reduce_dtype_for(mode, "bf16") == "bf16"
    for other in ("per_micro_batch", "deferred", "defer_all_reduce"):
        assert reduce_dtype_for(other, "auto") == "auto"  # accelerate's choice stays


def test_the_estimate_shows_fp32_and_bf16_bytes_for_auto_and_budget():
    est = estimate("recipe-default", bf16_config(2), M, GradSyncConfig(memory_budget="1GiB", free_memory="1GiB"))
    params = est.params
    for name in ("budget", "auto"):
        row = next(m for m in est.modes if m.mode.startswith(name))
        assert row.held_dtype == "fp32" and row.held_bytes == 4 * params, row
        assert row.held_bytes_compute_dtype == 2 * params, row
    deferred = est.mode("deferred")
    assert deferred.held_dtype == "bf16" and deferred.held_bytes_compute_dtype == 0
    table = format_table(est)
    assert "(bf16: " in table and "held dtype: what held gradients are summed in over the 4 micro-batches" in table
    chosen = estimate("recipe-default", bf16_config(2), M, GradSyncConfig(sync_mode="auto", reduce_dtype="bf16"))
    assert all(m.held_dtype in ("", "bf16") for m in chosen.modes if m.applicable), chosen.modes


def test_fsdp1_auto_does_not_defer_where_it_would_sum_in_bf16():
    est = estimate("recipe-default", bf16_config(1), M, GradSyncConfig(sync_mode="auto", free_memory="1GiB"))
    assert est.mode("auto -> per_micro_batch").units_held == 0
    assert "auto does not defer" in est.mode("auto -> per_micro_batch").reason
    assert est.mode("deferred").held_dtype == "bf16"  # deferred itself still defers, with the warning
    bf16 = GradSyncConfig(sync_mode="auto", reduce_dtype="bf16", free_memory="1GiB")
    kept = estimate("recipe-default", bf16_config(1), M, bf16)
    assert kept.mode("auto -> deferred").units_held > 0  # bf16 chosen: auto defers


def test_the_decision_line_says_what_held_gradients_are_summed_in():
    adapter, plan = _plan(GradSyncConfig(memory_budget="1GiB"))
    line = describe_decision(plan, adapter, M)
    assert "summed in float32 (the reduce dtype, over bfloat16 compute) as per micro-batch sums them" in line, line
    adapter, plan = _plan(GradSyncConfig(defer=True))
    line = describe_decision(plan, adapter, M)
    assert "summed in bfloat16" in line and "the gradients differ; reduce_dtype=fp32" in line, line


def _low_precision_warnings(config: GradSyncConfig, version: int = 2, mode: str | None = None) -> list[str]:
    """What `warn_about_plan` says at bind; `auto`'s first plan holds nothing (step 1 measures)."""
    adapter, plan = _plan(config, version, mode)
    if config.mode == "auto":
        plan = Plan("auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GradSyncWarning)
        warn_about_plan(plan, adapter, config.resolved(), M)
    return [str(w.message) for w in caught if "sums the held gradients" in str(w.message)]


def test_bf16_deferral_warns_once_with_the_fix():
    (warning,) = _low_precision_warnings(GradSyncConfig(defer=True))
    assert "reduce_dtype: fp32 (--grad-sync-reduce-dtype fp32, ACCEL_GRADSYNC_REDUCE_DTYPE=fp32)" in warning
    assert not _low_precision_warnings(GradSyncConfig(defer=True, reduce_dtype="bf16"))  # chosen knowingly
    assert not _low_precision_warnings(GradSyncConfig(defer=True, reduce_dtype="fp32"))
    assert not _low_precision_warnings(GradSyncConfig(memory_budget="1GiB"))  # fp32 by default


def test_auto_attached_too_late_for_fp32_warns_once_at_bind():
    """A model prepared before attach keeps accelerate's bf16 reduce: auto may hold it from step 2 on."""
    (warning,) = _low_precision_warnings(GradSyncConfig(sync_mode="auto"), mode="deferred")
    assert "auto, from step 2 on where it defers," in warning and "before accelerator.prepare()" in warning
    assert not _low_precision_warnings(GradSyncConfig(sync_mode="auto"))


def test_fsdp1_deferral_warns_that_the_reduce_dtype_cannot_help():
    (warning,) = _low_precision_warnings(GradSyncConfig(defer=True, reduce_dtype="fp32"), version=1)
    assert "fsdp1's no_sync() holds the compute dtype whatever the reduce dtype" in warning, warning
