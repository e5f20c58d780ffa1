"""Every key `GradSyncHandle.stats()` reports, and the test that checks it against a count taken
from outside (the collective counter, the tensors' bytes) or a figure derived in the test itself
(the model's sizes, the configured mode), never against the package's own plan or cost functions.

A real run's `stats()` is checked against this registry by the launches that produce one
(test_accumulate.py for FSDP2, FSDP1 and DDP, test_modes.py for auto and HSDP), so a counter added
to `stats()` fails there until it has a test here; test_stats_keys.py checks that each named test
exists and reads its key.
"""

from __future__ import annotations

# Test nodes under tests/distributed/.
ACCUMULATE = "test_accumulate.py::test_every_counter_against_outside_counts_and_the_models_sizes"
LIVE = "test_accumulate.py::test_live_counters_equal_real_collectives"
WRAPPED = "test_accumulate.py::test_model_is_wrapped_as_configured"
HSDP = "test_modes.py::test_hsdp_all_reduce_deferral_keeps_gradients_sharded"
ABORTS = "test_reliability_edge.py::test_aborted_accumulation_restores_flags_and_leaves_no_gradient"
AUTO = "test_auto.py::test_a_growing_peak_on_one_rank_falls_back_on_both_and_quiet_steps_move_it_back_up"
FORECAST = "test_forecast_auto.py::test_step_one_runs_the_forecast_plan_with_no_measuring_step"
ADAPTER = "test_sharded_by_transformers.py::test_a_peft_adapter_added_after_load_time_sharding_is_governed_and_counted"
REFERENCE = "test_grpo_reference.py::test_the_reference_model_gathers_once_per_step_and_changes_nothing"
TWO_MODELS = "test_two_models.py::test_each_model_has_its_own_counters_and_decision_line"
FROZEN_UNITS = "test_frozen_units.py::test_after_the_first_step_only_the_adapters_are_gathered"
UNEVEN_STEPS = "test_uneven_steps.py::test_fsdp2_every_mode_ends_at_the_padded_run_with_per_rank_counts"

REGISTRY: dict[str, str] = {
    "mode": ACCUMULATE,
    "mode_selected": ACCUMULATE,
    "wrapper": WRAPPED,
    "hsdp": HSDP,
    "units": ACCUMULATE,
    "unit_modes": ACCUMULATE,
    "optimizer_steps": LIVE,
    "aborted_steps": ABORTS,
    "peak_held_grad_bytes": HSDP,
    "plan_changes": AUTO,
    "units_per_micro_batch": ACCUMULATE,
    "units_deferred": ACCUMULATE,
    "units_windowed": ADAPTER,
    "units_defer_all_reduce": HSDP,
    "units_frozen": ADAPTER,
    "units_resident": FROZEN_UNITS,
    "resident_param_bytes": FROZEN_UNITS,
    "measured_peaks": AUTO,
    "measured_peak_bytes": FORECAST,
    "forecast_peak_bytes": FORECAST,
    "micro_batches": LIVE,
    "deferred_micro_batches": LIVE,
    "reduce_scatters_issued": ACCUMULATE,
    "reduce_scatters_skipped": ACCUMULATE,
    "all_reduces_issued": HSDP,
    "all_reduces_skipped": HSDP,
    "bytes_reduced": ACCUMULATE,
    "all_gathers": LIVE,
    "generation_all_gathers": LIVE,
    "replicated_all_reduces": ADAPTER,
    "replayed_micro_batches": UNEVEN_STEPS,
    "evened_micro_batches": UNEVEN_STEPS,
    "reference_units": REFERENCE,
    "reference_all_gathers": REFERENCE,
    "reference_models": ACCUMULATE,
    "models": TWO_MODELS,
    # The last finished optimizer step's own.
    "last_step/micro_batches": LIVE,
    "last_step/deferred_micro_batches": ACCUMULATE,
    "last_step/reduce_scatters_issued": ACCUMULATE,
    "last_step/reduce_scatters_skipped": ACCUMULATE,
    "last_step/all_reduces_issued": ACCUMULATE,
    "last_step/all_reduces_skipped": ACCUMULATE,
    "last_step/bytes_reduced": ACCUMULATE,
    "last_step/all_gathers": ACCUMULATE,
    "last_step/generation_all_gathers": ACCUMULATE,
    "last_step/replicated_all_reduces": ADAPTER,
    "last_step/held_grad_bytes": ACCUMULATE,
    "last_step/reference_all_gathers": REFERENCE,
    "last_step/replayed_micro_batches": UNEVEN_STEPS,
    "last_step/evened_micro_batches": UNEVEN_STEPS,
    "last_step/fewest_micro_batches": UNEVEN_STEPS,
    "last_step/most_micro_batches": UNEVEN_STEPS,
}


def unregistered(stats: dict) -> list[str]:
    """The keys of a real run's `stats()`, each bound model's under `models` included, that no
    test here checks."""
    keys = set(stats) | {k for model in stats.get("models", {}).values() for k in model}
    return sorted(keys - set(REGISTRY))
