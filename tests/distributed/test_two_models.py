"""Two trained models on one accelerator (policy and value, each prepared
with its own optimizer) plus a frozen reference model, one `attach`, deferred, M = 4, 2 optimizer
steps. What `stats()` says must add up to what ran, counted from outside, the held bytes to the
gradient bytes of both models' parameters, and each model gets its own decision line and its own
counters; the frozen model gets no plan (under FSDP2 a line and counters of its own, apart). FSDP2
and FSDP1. Under budget the reference model stays unsharded for the whole run where its bytes fit
the budget, and the trained models are planned within the rest; where they do not, with
gather_for_generation, it keeps its whole unsharded params through its no-grad forwards and the
trained models are planned within the budget less what it keeps beyond one unit's.

Then (FSDP2, the same launch) progressive unfreezing: the reference model, prepared frozen, is
given trainable parameters and trains beside the policy; from its next window on it is governed
like any trained model: U reduce-scatters per optimizer step counted from outside (not M x U,
what FSDP2 does for a model no one holds), its counters among the trained models', a decision line
of its own. Then the policy is frozen whole: it stays a trained model, planned again with nothing
to hold. Every parameter ends each phase where an unwrapped replica trained on all ranks' data ends."""

import json

import pytest
from launcher import accelerate_config, launch
from workers.common import TinyNet

from accel_gradsync.planning.costs import format_bytes

M, STEPS = 4, 2
N = 2  # ranks
FSDP1_PAD = TinyNet.UNITS * (N - 1) * 4  # FSDP1 pads each unit's flat fp32 gradient to a multiple of N elements


@pytest.fixture(scope="module", params=["fsdp2", pytest.param("fsdp1", marks=pytest.mark.slow)])
def ranks(request):
    unfreeze = ["--unfreeze"] if request.param == "fsdp2" else []  # then unfreezing.py's phases
    # The reference model resident (FSDP2) until it is unfrozen: bound again, it gives its units back.
    sync = json.dumps({"defer": True, "keep_reference_unsharded": True})
    args = ["--M", str(M), "--steps", str(STEPS), "--sync", sync, *unfreeze]
    return request.param, launch("two_models", args, accelerate_config(request.param))


def test_window_counts_once_and_collectives_add_up(ranks):
    _, results = ranks
    for rank in results:
        stats, counts = rank["stats"], rank["counts"]
        assert stats["optimizer_steps"] == STEPS and stats["micro_batches"] == M * STEPS
        assert stats["deferred_micro_batches"] == (M - 1) * STEPS
        real = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
        assert stats["reduce_scatters_issued"] == real == 2 * TinyNet.UNITS * STEPS  # both models, U per step
        assert stats["reduce_scatters_skipped"] == 2 * TinyNet.UNITS * (M - 1) * STEPS
        assert stats["units"] == 2 * TinyNet.UNITS


def test_both_models_hold_their_whole_gradient_at_once(ranks):
    """Before the window's last forward each deferred model holds the unsharded gradient of every
    trainable parameter: the bytes read from the parameters before wrapping, per model and added up."""
    kind, results = ranks
    pad = 0 if kind == "fsdp2" else FSDP1_PAD
    for rank in results:
        models = rank["models"]
        for (name, model), expected in zip(sorted(models.items()), rank["grad_bytes"], strict=True):
            for held in (model["peak_held_grad_bytes"], model["last_step/held_grad_bytes"]):
                assert expected <= held <= expected + pad, (name, held, expected)
        total, peak = sum(rank["grad_bytes"]), rank["stats"]["peak_held_grad_bytes"]
        assert total <= peak <= total + 2 * pad, (peak, total)


def test_each_model_has_its_own_counters_and_decision_line(ranks):
    kind, results = ranks
    for rank in results:
        models = rank["models"]
        assert sorted(models) == ["TinyNet", "TinyNet#2"]  # the frozen reference model is not bound
        for model in models.values():
            assert model["units"] == TinyNet.UNITS and model["optimizer_steps"] == STEPS
            assert model["reduce_scatters_issued"] == TinyNet.UNITS * STEPS
        assert sorted(rank["stats"]["unit_modes"]) == sorted(
            f"{name}/{unit}" for name, m in models.items() for unit in m["unit_modes"]
        )
    lines = results[0]["decisions"]  # printed on the main process only
    reference = [d for d in lines if d.startswith(("grad sync: reference model", "grad sync:   why: keep_reference"))]
    decisions = [d for d in lines if d not in reference]
    assert len(decisions) == 2 and all(f"on {kind}" in d and "3 deferred" in d for d in decisions), decisions
    # FSDP2: the frozen model's all-gathers are counted apart, and its lines say what it gathers and why.
    assert len(reference) == (2 if kind == "fsdp2" else 0), lines
    if kind == "fsdp2":
        assert "kept unsharded for the whole run" in reference[0]
        assert all(r["reference_all_gathers_per_step"] == [U, 0] for r in results), results
        # save_state and load_state reshard it (FSDP2's state-dict hooks); its forwards after each gather
        # its units again (two forwards: U + U) and compute the same.
        for r in results:
            assert r["checkpoint"] == {"all_gathers_after_save": 2 * U, "same_output": True}, r["checkpoint"]
        # An exception mid-forward releases it: the next two forwards gather U (then none), the third
        # none, and all compute the same; it is still resident.
        for r in results:
            expected = {"raised": "injected failure", "all_gathers": [U, 0], "same_output": True, "resident": True}
            assert r["exception"] == expected, r["exception"]
    assert not results[1]["decisions"]


@pytest.mark.parametrize("fits", [True, False])
def test_budget_keeps_the_reference_resident_only_where_it_fits_and_plans_within_the_rest(fits):
    """The reference model (3 units, T bytes: a TinyNet's) is bound after the trained ones (attach
    after prepare), so their plans are made again. Budget 2T: the reference fits, stays unsharded
    for the whole run (its all-gathers in step 1 only, counted from outside) and T comes off the budget first;
    gather_for_generation takes T more, so the trained models hold nothing. Budget T - 1: it does
    not fit, gathers again every step, and keeps through a pass T less its largest unit."""
    net = TinyNet()
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in (*net.blocks, net.head)]
    total, units = sum(unit_bytes), TinyNet.UNITS
    budget, reserved = (2 * total, total) if fits else (total - 1, total - max(unit_bytes))
    sync = {"sync_mode": "budget", "memory_budget": f"{budget}B", "gather_for_generation": True}
    results = launch(
        "two_models", ["--M", str(M), "--steps", str(STEPS), "--sync", json.dumps(sync)], accelerate_config("fsdp2")
    )
    for rank in results:
        assert rank["unit_bytes"] == unit_bytes
        assert len(rank["plans"]) == 2
        for plan in rank["plans"]:
            assert plan["generation_bytes"] == total
            assert plan["held"] == 0, plan  # nothing is left of the budget
        reference = rank["stats"]["reference_models"]["TinyNet#3"]
        assert reference["units"] == units and reference["resident"] is fits
        # Its all-gathers: every unit once, in step 1 only, where resident. Where not, each micro-batch's
        # forward with gradients releases it: its blocks gather again in every micro-batch's reference
        # forward, its root (FSDP2 leaves a root unsharded after forward) once, at the first.
        blocks = (units - 1) * M
        assert rank["reference_all_gathers_per_step"] == ([units, 0] if fits else [blocks + 1, blocks]), rank
    lines = results[0]["decisions"]
    at = next(i for i, line in enumerate(lines) if line.startswith("grad sync: reference model"))
    said, why = lines[at : at + 2]
    assert ("kept unsharded for the whole run" in said) is fits, said
    assert f"{'fit' if fits else 'do not fit'} the {format_bytes(budget)} of budget's budget" in why, why
    replanned = [line for line in lines if f"{format_bytes(reserved)} kept by reference models" in line]
    assert len(replanned) == 2, lines  # each trained model's plan, made again


U, POLICY, LATE = TinyNet.UNITS, "TinyNet", "TinyNet#3"  # the reference model: the third TinyNet bound


def unfreezing(ranks) -> list[dict]:
    kind, results = ranks
    if kind != "fsdp2":
        pytest.skip("unfreezing runs on FSDP2 (an FSDP1 flat parameter has one requires_grad)")
    return results


def test_an_unfrozen_reference_model_is_governed_from_its_next_window(ranks):
    results = unfreezing(ranks)
    for rank in results:
        before, phase = rank["stats"], rank["unfreezing"][0]
        stats = phase["stats"]
        assert before["reference_models"] == {LATE: before["reference_models"][LATE]}  # frozen until then
        # Two deferred models: U reduce-scatters each per optimizer step, counted from outside.
        assert phase["reduce_scatters"] == 2 * U * STEPS, phase["reduce_scatters"]
        assert stats["reduce_scatters_issued"] - before["reduce_scatters_issued"] == phase["reduce_scatters"]
        assert sorted(stats["models"]) == ["TinyNet", "TinyNet#2", LATE]
        assert stats["reference_models"] == {} and stats["reference_units"] == 0
        late = stats["models"][LATE]
        assert late["reduce_scatters_issued"] == U * STEPS and late["last_step/reduce_scatters_issued"] == U
        assert late["last_step/reduce_scatters_skipped"] == U * (M - 1)
        assert set(late["unit_modes"].values()) == {"deferred"}
    lines = results[0]["unfreezing"][0]["decisions"]
    assert len(lines) == 1 and lines[0].startswith(f"grad sync: deferred over {M} micro-batches on fsdp2 (3 deferred)")
    assert not results[1]["unfreezing"][0]["decisions"]  # the main process prints


def test_a_model_frozen_whole_stays_a_trained_model_with_every_unit_frozen(ranks):
    """Its counters go on (stats() totals since attach only grow); its plan is made again and
    printed: nothing to hold, so no reduce-scatter of it is counted or skipped."""
    results = unfreezing(ranks)
    for rank in results:
        before, phase = rank["unfreezing"][0]["stats"], rank["unfreezing"][1]
        stats = phase["stats"]
        assert phase["reduce_scatters"] == U * STEPS  # the unfrozen model alone
        assert stats["reduce_scatters_issued"] - before["reduce_scatters_issued"] == phase["reduce_scatters"]
        assert sorted(stats["models"]) == ["TinyNet", "TinyNet#2", LATE] and stats["reference_models"] == {}
        policy = stats["models"][POLICY]
        assert set(policy["unit_modes"].values()) == {"frozen"}
        assert policy["last_step/reduce_scatters_issued"] == policy["last_step/reduce_scatters_skipped"] == 0
        assert policy["reduce_scatters_issued"] == before["models"][POLICY]["reduce_scatters_issued"]
    lines = results[0]["unfreezing"][1]["decisions"]
    assert len(lines) == 1 and lines[0].startswith(
        f"grad sync: deferred over {M} micro-batches on fsdp2 (3 frozen) -> 0 "
    )


def test_unfrozen_and_frozen_models_match_a_replica(ranks):
    for rank in unfreezing(ranks):
        for phase in rank["unfreezing"]:
            assert max(phase["max_param_diff"].values()) < 1e-5, phase["max_param_diff"]
