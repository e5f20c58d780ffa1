"""Models transformers shards at load time (`DistributedConfig`, FSDP and HSDP meshes) behave as
ones accelerate prepared: under the `Trainer` (which defers by itself unless governed) and in a
plain loop with `accelerator.no_sync`, every sync mode applies, and the plugin's `stats()` and
decision line say what the collectives counted from outside show."""

from __future__ import annotations

import json
import re

import pytest
import torch
from launcher import launch

M, STEPS = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM
    from workers.common import tiny_qwen2_config

    config = tiny_qwen2_config(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def recipe_model_dir(tmp_path_factory):
    """The GRPO recipe's built-in model and tokenizer, saved as a user's model directory."""
    import sys

    from launcher import REPO

    sys.path.insert(0, str(REPO / "recipes"))
    import embedded

    torch.manual_seed(0)
    tokenizer = embedded.build_tokenizer()
    path = tmp_path_factory.mktemp("recipe_model")
    embedded.build_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


FSDP_RUNS = [
    {"name": "per_micro_batch", "entry": "trainer", "config": {}},
    {"name": "deferred", "entry": "trainer", "config": {"defer": True}},
    {"name": "windowed", "entry": "trainer", "config": {"defer": True, "keep_params_unsharded": True}},
    {"name": "budget", "entry": "trainer", "config": {"memory_budget": "1GiB"}},
    {"name": "auto", "entry": "trainer", "config": {"sync_mode": "auto", "free_memory": "64GiB"}},
    {"name": "loop_deferred", "entry": "loop", "config": {"defer": True}},
    {"name": "loop_per_micro_batch", "entry": "loop", "config": {}},
    {"name": "loop_budget_without_M", "entry": "loop", "config": {"memory_budget": "1GiB"}},
]
HSDP_RUNS = [
    {"name": "per_micro_batch", "entry": "trainer", "config": {}},
    {"name": "defer_all_reduce", "entry": "trainer", "config": {"sync_mode": "defer_all_reduce"}},
    {"name": "deferred", "entry": "trainer", "config": {"defer": True}},
]


GRPO_RUNS = [
    {"name": "per_micro_batch", "entry": "grpo", "config": {}},
    {"name": "deferred", "entry": "grpo", "config": {"defer": True}},
]


# A LoRA adapter added after transformers sharded the model: the FSDP2 units hold the frozen base
# weights, the adapter's weights are plain tensors transformers' Trainer all-reduces itself. They
# run in the FSDP runs' launch (the same model and mesh), named `lora_<mode>`.
LORA_RUNS = [
    {"name": "lora_per_micro_batch", "entry": "trainer", "config": {}, "lora": True},
    {
        "name": "lora_windowed",
        "entry": "trainer",
        "config": {"defer": True, "keep_params_unsharded": True},
        "lora": True,
    },
]


@pytest.fixture(scope="module")
def grpo(recipe_model_dir):
    return launch("sharded_by_transformers", ["--model", recipe_model_dir, "--runs", json.dumps(GRPO_RUNS)])


@pytest.fixture(scope="module")
def fsdp(model_dir):
    return launch("sharded_by_transformers", ["--model", model_dir, "--runs", json.dumps(FSDP_RUNS + LORA_RUNS)])


@pytest.fixture(scope="module")
def hsdp(model_dir):
    args = ["--model", model_dir, "--replicate", "2", "--runs", json.dumps(HSDP_RUNS)]
    return launch("sharded_by_transformers", args, nprocs=4)


def _decision_all_gathers(line: str) -> int:
    return int(re.search(r"(\d+) all-gathers/step", line).group(1))


@pytest.mark.parametrize("name", [r["name"] for r in FSDP_RUNS if r["name"] != "loop_budget_without_M"])
def test_stats_match_the_collectives_counted_from_outside(fsdp, name):
    for rank in fsdp:
        run = rank["runs"][name]
        stats, counts = run["stats"], run["counts"]
        assert stats["optimizer_steps"] == STEPS, stats
        assert stats["micro_batches"] == M * STEPS, stats
        assert counts["reduce_scatter_single"] == stats["reduce_scatters_issued"], (counts, stats)
        assert stats["reduce_scatters_issued"] + stats["reduce_scatters_skipped"] == stats["units"] * M * STEPS


@pytest.mark.parametrize(
    ("name", "held_windows"),
    [
        ("per_micro_batch", 0),
        ("deferred", STEPS),
        ("windowed", STEPS),
        ("budget", STEPS),
        ("auto", STEPS - 1),
        ("loop_deferred", STEPS),
        ("loop_per_micro_batch", 0),
    ],
)
def test_every_mode_applies(fsdp, name, held_windows):
    """Each held window reduce-scatters each unit once instead of M times; auto's first step
    measures, syncing every micro-batch. transformers' own deferral would hold every window."""
    for rank in fsdp:
        run = rank["runs"][name]
        units = run["stats"]["units"]
        synced_windows = STEPS - held_windows
        assert run["counts"]["reduce_scatter_single"] == units * (held_windows + synced_windows * M), run["counts"]


@pytest.mark.parametrize("name", ["per_micro_batch", "deferred", "windowed"])
def test_the_decision_line_counts_what_ran(fsdp, name):
    for rank in fsdp:
        run = rank["runs"][name]
        stats = run["stats"]
        rs = int(re.search(r"-> (\d+) reduce-scatters", run["decision"]).group(1))
        assert rs * STEPS == stats["reduce_scatters_issued"], run["decision"]
        assert _decision_all_gathers(run["decision"]) * STEPS == run["counts"]["all_gather_single"], run["decision"]


def test_the_trainer_is_governed_and_training_is_the_same(fsdp):
    reference = fsdp[0]["runs"]["per_micro_batch"]
    for rank in fsdp:
        for name in ("deferred", "windowed", "budget", "auto"):
            run = rank["runs"][name]
            assert run["hooked_as"] == "GradSyncTrainer", run["hooked_as"]
            assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5), name
            for key, value in run["weights"].items():
                assert torch.allclose(torch.tensor(value), torch.tensor(reference["weights"][key]), atol=1e-6), key


def test_explicit_no_sync_outside_accumulate(fsdp):
    """accelerate's documented loop: no_sync holds in deferred mode (the plugin learns M from the
    first window and says so), per_micro_batch overrides it with one warning, and budget refuses
    an Accelerator that does not say M, before any gradient is reduced."""
    for rank in fsdp:
        runs = rank["runs"]
        assert "over 4 micro-batches" in runs["loop_deferred"]["decision"], runs["loop_deferred"]["decision"]
        overridden = [w for w in runs["loop_per_micro_batch"]["warnings"] if "overridden" in w]
        assert len(overridden) == 1, runs["loop_per_micro_batch"]["warnings"]
        assert not [w for w in runs["loop_deferred"]["warnings"] if "overridden" in w]
        refused = runs["loop_budget_without_M"]
        assert "gradient_accumulation_steps=1" in refused["error"], refused
        assert refused["counts"].get("reduce_scatter_single", 0) == 0, refused
    reference = fsdp[0]["runs"]["loop_per_micro_batch"]
    for key, value in fsdp[0]["runs"]["loop_deferred"]["weights"].items():
        assert torch.allclose(torch.tensor(value), torch.tensor(reference["weights"][key]), atol=1e-6), key


@pytest.mark.slow  # 4 processes (a 2x2 mesh)
@pytest.mark.parametrize(
    ("name", "all_reduce_windows"), [("per_micro_batch", 0), ("defer_all_reduce", STEPS), ("deferred", STEPS)]
)
def test_hsdp_modes_apply_and_are_counted(hsdp, name, all_reduce_windows):
    """transformers' own HSDP deferral holds only the all-reduce; here each mode does what it says."""
    for rank in hsdp:
        run = rank["runs"][name]
        stats, counts, units = run["stats"], run["counts"], run["stats"]["units"]
        assert stats["hsdp"] is True
        assert (
            counts["all_reduce"]
            == stats["all_reduces_issued"]
            == units * (all_reduce_windows + (STEPS - all_reduce_windows) * M)
        ), (counts, stats)
        assert counts["reduce_scatter_single"] == stats["reduce_scatters_issued"], (counts, stats)


MESHES = [
    ({"fsdp_size": 2}, "fsdp"),
    pytest.param({"fsdp_size": 2, "dp_replicate_size": 2}, "hsdp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh", "runs"), MESHES)
def test_the_estimate_plans_what_the_run_did(model_dir, mesh, runs, request):
    """`accel-gradsync estimate --distributed-config` shards the meta model with transformers' own
    code: its rows give the collectives each mode's run counted from outside."""
    from accel_gradsync.estimator.core import estimate

    ranks = request.getfixturevalue(runs)
    est = estimate(model_dir, None, M, distributed_config=mesh)
    assert est.sharded_by == "transformers" and est.replicate_size == mesh.get("dp_replicate_size", 1)
    rows = {
        "per_micro_batch": "per_micro_batch",
        "deferred": "deferred",
        "windowed": "deferred+windowed",
        "defer_all_reduce": "defer_all_reduce",
    }
    for name, run in ranks[0]["runs"].items():
        if name not in rows:  # auto's run measures its first step; budget's row needs a budget
            continue
        row = est.mode(rows[name])
        assert row.reduce_scatters * STEPS == run["counts"]["reduce_scatter_single"], name
        assert row.all_reduces * STEPS == run["counts"].get("all_reduce", 0), name
        assert row.all_gathers * STEPS == run["counts"]["all_gather_single"], name
    assert len(est.units) == ranks[0]["runs"]["per_micro_batch"]["stats"]["units"]


def test_a_peft_adapter_added_after_load_time_sharding_is_governed_and_counted(fsdp):
    """PEFT's wrapper is no FSDP module: the plugin finds the FSDP2 root inside it, so the window
    keeps the frozen units' params through each window, and counts the all-reduces transformers'
    Trainer issues for the adapter's weights (one per tensor per optimizer step) as they ran."""
    for rank in fsdp:
        runs = {r["name"]: rank["runs"][r["name"]] for r in LORA_RUNS}
        for name, run in runs.items():
            stats, counts = run["stats"], run["counts"]
            assert not [w for w in run["warnings"] if "not wrapped" in w], run["warnings"]
            assert run["hooked_as"] == "GradSyncTrainer" and stats["wrapper"] == "fsdp2", name
            assert stats["units"] > 0 and stats["optimizer_steps"] == STEPS, stats
            assert stats["units_frozen"] + stats["units_windowed"] == stats["units"], stats  # only the adapter trains
            assert counts["all_reduce"] == stats["replicated_all_reduces"] == run["trainable_tensors"] * STEPS, name
            assert stats["last_step/replicated_all_reduces"] == run["trainable_tensors"], stats
        window, per_micro_batch = runs["lora_windowed"], runs["lora_per_micro_batch"]
        assert window["stats"]["units_windowed"] == window["stats"]["units"]
        assert window["counts"]["all_gather_single"] < per_micro_batch["counts"]["all_gather_single"]
        assert window["losses"] == pytest.approx(per_micro_batch["losses"], abs=1e-5)


@pytest.mark.slow
def test_a_trl_trainer_is_governed_too(grpo):
    """GRPOTrainer subclasses the Trainer: the same deferral path, the same governance."""
    for rank in grpo:
        for name, held in (("per_micro_batch", False), ("deferred", True)):
            run = rank["runs"][name]
            units, stats = run["stats"]["units"], run["stats"]
            assert run["hooked_as"] == "GradSyncGRPOTrainer"
            assert run["counts"]["reduce_scatter_single"] == stats["reduce_scatters_issued"]
            assert stats["reduce_scatters_issued"] == units * STEPS * (1 if held else M), stats
        assert rank["runs"]["deferred"]["losses"] == pytest.approx(rank["runs"]["per_micro_batch"]["losses"], abs=1e-5)
