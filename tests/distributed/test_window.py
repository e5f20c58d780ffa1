"""Parameters unsharded for the whole accumulation window (FSDP2 `keep_params_unsharded`
with deferral, and the windowed level `budget` picks per unit), on real gloo ranks: all-gathers
counted from outside, gradients equal to a single-process reference every step, every flag back
as it was, params resharded before the optimizer step and after an aborted window."""

import json

import pytest
from launcher import accelerate_config, launch
from workers.common import TinyNet

M, BATCHES = 4, 6
WINDOWS = [4, 2]  # a full window, then the dataloader's short end
UNITS = TinyNet.UNITS
WINDOWED = {"defer": True, "keep_params_unsharded": True}
RUNS = [
    {"name": "per_micro_batch", "config": {}},
    {"name": "deferred", "config": {"defer": True}},
    {"name": "windowed", "config": WINDOWED},
    {"name": "windowed_after_abort", "config": WINDOWED, "abort_after": 2},
    # Something outside the plan reshards the window's params: a state_dict() in the middle of a
    # window (save_state takes one), an evaluation after every optimizer step.
    {"name": "windowed_state_dict", "config": WINDOWED, "state_dict_after": 1},
    {"name": "windowed_eval_between", "config": WINDOWED, "eval_between": True},
    {"name": "windowed_two_forwards", "config": WINDOWED, "forwards": 2},
    # Per unit, fp32: a Block holds 1088 B of gradient and 1088 B of params, the root's head 68 + 68 B.
    # On 2 gloo ranks deferring a unit saves 3 reduce-scatters of 1.4 all-gather bytes each
    # (policies.REDUCE_SCATTER_COST) per half a gradient byte it adds (the sharded half is not kept):
    # 8.4 per byte at M = 4, before a window's 7 all-gathers per param byte.
    # 3340 B: every unit deferred (2244 B), then one Block windowed (1088 B more); the head's window
    # (68 B more) no longer fits.
    {"name": "budget_3340B", "config": {"sync_mode": "budget", "memory_budget": "3340B"}},
    # 2200 B: both Blocks deferred; the head's 68 B no longer fit.
    {"name": "budget_2200B", "config": {"sync_mode": "budget", "memory_budget": "2200B"}},
    {"name": "budget_ample", "config": {"sync_mode": "budget", "memory_budget": "1MiB"}},
]


def _args(runs):
    return ["--M", str(M), "--batches", str(BATCHES), "--runs", json.dumps(runs)]


def _gathers(res):
    return [
        s["counts"].get("all_gather_single", 0) + s["counts"].get("all_gather_into_tensor", 0) for s in res["steps"]
    ]


@pytest.fixture(scope="module")
def fp32():
    return launch("accumulate", _args(RUNS), accelerate_config("fsdp2"))


@pytest.fixture(scope="module")
def variants():
    """bf16 params with an fp32 reduce, and activation checkpointing of the Blocks."""
    bf16 = {**accelerate_config("fsdp2"), "mixed_precision": "bf16"}
    checkpointed = accelerate_config("fsdp2", fsdp_activation_checkpointing=True)
    runs = [{"name": "windowed", "config": {**WINDOWED, "reduce_dtype": "fp32"}, "attach_before_prepare": True}]
    return {
        "bf16_fp32_reduce": launch("accumulate", _args(runs), bf16),
        "activation_checkpointing": launch(
            "accumulate", _args([{"name": "windowed", "config": WINDOWED}]), checkpointed
        ),
    }


@pytest.mark.compat
def test_windowed_gathers_each_unit_once_per_step_and_matches_the_reference(fp32):
    for rank in fp32:
        modes = rank["modes"]
        for name, res in modes.items():
            for step in res["steps"]:
                assert step["max_diff"] <= 1e-5, (name, step)
        per_mb, deferred, window = (_gathers(modes[n]) for n in ("per_micro_batch", "deferred", "windowed"))
        # U all-gathers per optimizer step whatever M is (the first step finds the root still
        # gathered by the evaluation pass before it: FSDP2 never reshards the root after forward).
        assert window[1:] == [UNITS] * (len(WINDOWS) - 1) and window[0] <= UNITS
        assert deferred == per_mb and all(
            w < p for w, p in zip(window, per_mb, strict=True)
        )  # deferral alone gathers as often
        assert sorted(modes["windowed"]["windowed"]) == ["", "blocks.0", "blocks.1"]


def assert_collectives_counted_as_ran(name: str, res: dict) -> dict:
    """stats()' all-gathers (training and no-grad) and reduce-scatters equal the ones counted
    from outside; returns stats()."""
    counted, ran = res["counted"], res["ran"]
    gathers = counted["all_gathers"] + counted["generation_all_gathers"]
    assert gathers == ran.get("all_gathers", 0), (name, counted, ran)
    assert counted["reduce_scatters_issued"] == ran.get("reduce_scatters", 0), (name, counted, ran)
    return counted


def test_live_counters_equal_the_collectives_that_ran(fp32):
    """Counted from what FSDP does, not from what the plan expects: a state_dict() in the middle of a
    window reshards its units and the next forward gathers them again; an evaluation between steps
    gathers too."""
    for rank in fp32:
        for name, res in rank["modes"].items():
            counted = assert_collectives_counted_as_ran(name, res)
            assert counted["micro_batches"] == BATCHES and counted["optimizer_steps"] == len(WINDOWS), name
            assert all(step["max_diff"] <= 1e-5 for step in res["steps"]), name


def test_windowed_restores_every_flag_and_reshards_before_the_optimizer_step(fp32):
    for rank in fp32:
        names = ("windowed", "windowed_after_abort", "windowed_state_dict", "windowed_two_forwards")
        for name in (*names, "windowed_eval_between", "budget_3340B", "budget_ample"):
            res = rank["modes"][name]
            assert res["flags_restored"], name  # requires_gradient_sync, reshard_after_{forward,backward}
            # ZeRO-1 memory only inside the window (an evaluation after the last step leaves FSDP2's
            # root gathered, as any forward does).
            assert res["sharded_after_step"] or name == "windowed_eval_between", name


def test_an_aborted_window_reshards_and_the_next_window_is_exact(fp32):
    for rank in fp32:
        res = rank["modes"]["windowed_after_abort"]
        assert res["sharded_after_abort"]
        assert _gathers(res)[1:] == [UNITS] * (len(WINDOWS) - 1) and _gathers(res)[0] <= UNITS
        assert all(step["max_diff"] <= 1e-5 for step in res["steps"])


def test_budget_picks_levels_per_unit_and_holds_what_it_planned(fp32):
    for rank in fp32:
        tight, ample = rank["modes"]["budget_3340B"], rank["modes"]["budget_ample"]
        tighter = rank["modes"]["budget_2200B"]
        assert sorted(ample["windowed"]) == ["", "blocks.0", "blocks.1"]  # everything fits windowed
        assert _gathers(ample)[1:] == [UNITS] * (len(WINDOWS) - 1)
        assert tight["plan"]["held_bytes"] == 3 * 1088 + 68 <= 3340
        assert tight["windowed"] == ["blocks.0"] and sorted(tight["plan"]["held"]) == ["", "blocks.0", "blocks.1"]
        assert tighter["windowed"] == [] and sorted(tighter["plan"]["held"]) == ["blocks.0", "blocks.1"]
        assert "2 deferred, 1 per-micro-batch" in tighter["decision"], tighter["decision"]
        # Block 0 once; Block 1 in each forward and backward; the root's head in each forward.
        assert _gathers(tight)[1:] == [1 + 2 * m + m for m in WINDOWS[1:]]
        # The measured held gradient bytes are the plan's; the decision line names each level.
        for res in (tight, ample):
            assert res["stats"]["peak_held_grad_bytes"] == res["held_grad_bytes"]
        assert "1 windowed, 2 deferred" in tight["decision"], tight["decision"]
        assert "3 windowed" in ample["decision"] and f"{UNITS} all-gathers/step" in ample["decision"]


# A model transformers shards at load time, an evaluation forward after every optimizer step.
SHARDED_RUNS = [
    {"name": "per_micro_batch", "config": {}},
    {"name": "deferred", "config": {"defer": True}},
    {"name": "windowed", "config": WINDOWED},
]
SHARDED_M, SHARDED_STEPS = 2, 3


@pytest.fixture(scope="module")
def sharded_evaluation(tmp_path_factory):
    import torch
    from transformers import Qwen2ForCausalLM
    from workers.common import tiny_qwen2_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=False)).save_pretrained(path)
    args = [
        "--model",
        str(path),
        "--runs",
        json.dumps(SHARDED_RUNS),
        "--M",
        str(SHARDED_M),
        "--steps",
        str(SHARDED_STEPS),
    ]
    return launch("sharded_evaluation", args)


@pytest.mark.slow
def test_live_counters_of_a_transformers_sharded_model_evaluated_between_steps(sharded_evaluation):
    for rank in sharded_evaluation:
        for name, res in rank["runs"].items():
            counted = assert_collectives_counted_as_ran(name, res)
            assert counted["micro_batches"] == SHARDED_M * SHARDED_STEPS, (name, counted)
            assert counted["optimizer_steps"] == SHARDED_STEPS, (name, counted)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16_fp32_reduce", "activation_checkpointing"])
def test_windowed_with_bf16_fp32_reduce_and_activation_checkpointing(variants, variant):
    for rank in variants[variant]:
        res = rank["modes"]["windowed"]
        tolerance = 5e-2 if variant.startswith("bf16") else 1e-5  # bf16 compute against the fp32 reference
        assert all(step["max_diff"] <= tolerance for step in res["steps"]), res["steps"]
        # Recomputing a checkpointed Block in backward must not gather it again.
        assert _gathers(res)[1:] == [UNITS] * (len(WINDOWS) - 1) and _gathers(res)[0] <= UNITS, variant
        assert res["flags_restored"] and res["sharded_after_step"]
        # A recomputed Block's forward runs with gradients inside backward: counted as what it gathers.
        counted = res["counted"]
        assert counted["all_gathers"] + counted["generation_all_gathers"] == res["ran"].get("all_gathers", 0), variant
