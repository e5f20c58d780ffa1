"""Progressive unfreezing, FSDP2, deferred, M = 4, attach after prepare (workers/unfreeze.py): a
model prepared frozen is a reference model until its parameters require gradients; from the next
window on it is governed like any trained model: U reduce-scatters per optimizer step counted
from outside (not M x U, what FSDP2 does for a model no one holds), its counters among the trained
models', a decision line of its own. A trained model frozen whole is planned again, with nothing
to hold.
Every parameter ends each phase where an unwrapped replica trained on all ranks' data ends."""

import pytest
from launcher import accelerate_config, launch
from workers.common import TinyNet

M, STEPS, U = 4, 2, TinyNet.UNITS
POLICY, LATE = "TinyNet", "TinyNet#2"  # bound in prepare order; the second of a class is #2


@pytest.fixture(scope="module")
def result():
    ranks = launch("unfreeze", ["--M", str(M), "--steps", str(STEPS)], accelerate_config("fsdp2"))
    return ranks


def test_frozen_phase_counts_the_late_model_as_a_reference(result):
    for rank in result:
        phase = rank["phases"][0]
        assert phase["reduce_scatters"] == U * STEPS  # the policy alone, deferred
        assert sorted(phase["stats"]["models"]) == [POLICY]
        assert sorted(phase["stats"]["reference_models"]) == [LATE]
    assert any(line.startswith(f"grad sync: reference model {LATE} ") for line in result[0]["at_attach"])


def test_unfrozen_model_is_governed_from_its_next_window(result):
    for rank in result:
        before, phase = rank["phases"][0]["stats"], rank["phases"][1]
        stats = phase["stats"]
        # Two deferred models: U reduce-scatters each per optimizer step, counted from outside.
        assert phase["reduce_scatters"] == 2 * U * STEPS, phase["reduce_scatters"]
        assert stats["reduce_scatters_issued"] - before["reduce_scatters_issued"] == phase["reduce_scatters"]
        assert sorted(stats["models"]) == [POLICY, LATE]
        assert stats["reference_models"] == {} and stats["reference_units"] == 0
        late = stats["models"][LATE]
        assert late["last_step/reduce_scatters_issued"] == U
        assert late["last_step/reduce_scatters_skipped"] == U * (M - 1)
        assert set(late["unit_modes"].values()) == {"deferred"}
    lines = result[0]["phases"][1]["decisions"]
    assert len(lines) == 1 and lines[0].startswith(f"grad sync: deferred over {M} micro-batches on fsdp2 (3 deferred)")
    assert not result[1]["phases"][1]["decisions"]  # the main process prints


def test_model_frozen_whole_stays_a_trained_model_with_every_unit_frozen(result):
    """Its counters go on (stats() totals since attach only grow); its plan is made again and
    printed: nothing to hold, so no reduce-scatter of it is counted or skipped."""
    for rank in result:
        before, phase = rank["phases"][1]["stats"], rank["phases"][2]
        stats = phase["stats"]
        assert phase["reduce_scatters"] == U * STEPS  # the late model alone
        assert stats["reduce_scatters_issued"] - before["reduce_scatters_issued"] == phase["reduce_scatters"]
        assert sorted(stats["models"]) == [POLICY, LATE] and stats["reference_models"] == {}
        policy = stats["models"][POLICY]
        assert set(policy["unit_modes"].values()) == {"frozen"}
        assert policy["last_step/reduce_scatters_issued"] == policy["last_step/reduce_scatters_skipped"] == 0
        assert policy["reduce_scatters_issued"] == before["models"][POLICY]["reduce_scatters_issued"]
    lines = result[0]["phases"][2]["decisions"]
    assert len(lines) == 1 and lines[0].startswith(
        f"grad sync: deferred over {M} micro-batches on fsdp2 (3 frozen) -> 0 "
    )


def test_parameters_match_a_replica_in_every_phase(result):
    for rank in result:
        for phase in rank["phases"]:
            assert max(phase["max_param_diff"].values()) < 1e-5, phase["max_param_diff"]
