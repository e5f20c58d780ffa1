"""Real transformers models under FSDP2 on 2 gloo ranks: a tiny Qwen2 whose input
and output embeddings are one tied parameter, and the same model with PEFT LoRA adapters (the
base frozen; also under FSDP1). Every optimizer step's gradients equal a single-process reference, and only the
units holding trainable parameters are units.

The same launch builds a transformers Trainer whose accelerator config asks for
`sync_each_batch=True` and attaches deferral to it: the error must name both settings before
any step, and the Trainer's output_dir must stay empty."""

import json

import pytest
from launcher import accelerate_config, launch

M, BATCHES = 3, 4
WINDOWS = [3, 1]
MODES = {"per_micro_batch": {}, "deferred": {"defer": True}}


@pytest.fixture(scope="module")
def ranks():
    runs = [
        {"name": f"{model}_{mode}", "model": model, "config": cfg}
        for model in ("tied", "lora")
        for mode, cfg in MODES.items()
    ]
    config = accelerate_config("fsdp2")
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "Qwen2DecoderLayer"
    args = [
        "--runs",
        json.dumps(runs),
        "--M",
        str(M),
        "--batches",
        str(BATCHES),
        "--trainer-window",
        "--trainer-errors",
    ]
    return launch("reliability_models", args, config)


@pytest.mark.parametrize("model", ["tied", "lora"])
@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_match_single_process_reference(ranks, model, mode):
    for rank in ranks:
        run = rank["runs"][f"{model}_{mode}"]
        assert run["error"] is None, run["error"]
        assert len(run["steps"]) == run["expected_steps"] == len(WINDOWS)
        for step in run["steps"]:
            assert step["max_diff"] <= 1e-5 and not step["missing"] and not step["extra"], step
        units = run["unit_collectives"]
        expected = [units if mode == "deferred" else units * m for m in WINDOWS]
        assert [s["reduce_scatters"] for s in run["steps"]] == expected


@pytest.fixture(scope="module")
def fsdp1_lora():
    """LoRA under FSDP1, as the FSDP1 configs in accelerate_configs/ launch it (fsdp_use_orig_params:
    FSDP1 cannot flatten a unit's frozen base and trainable adapters into one tensor without it)."""
    runs = [{"name": f"lora_{mode}", "model": "lora", "config": cfg} for mode, cfg in MODES.items()]
    config = accelerate_config(
        "fsdp1", fsdp_use_orig_params=True, fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer"
    )
    return launch("reliability_models", ["--runs", json.dumps(runs), "--M", str(M), "--batches", str(BATCHES)], config)


@pytest.mark.parametrize("mode", list(MODES))
def test_lora_under_fsdp1_matches_the_single_process_reference(fsdp1_lora, mode):
    for rank in fsdp1_lora:
        run = rank["runs"][f"lora_{mode}"]
        assert run["error"] is None, run["error"]
        assert len(run["steps"]) == run["expected_steps"] == len(WINDOWS)
        for step in run["steps"]:
            assert step["max_diff"] <= 1e-5 and not step["missing"] and not step["extra"], step
            assert step["frozen_grad_max"] == 0.0, step  # the frozen base: nothing to reduce or apply
        assert run["trainable_names"] and all("lora_" in n for n in run["trainable_names"])
        # FSDP1 reduce-scatters each unit with trainable parameters (the 2 layers') once per sync;
        # deferral (no_sync at the root) syncs once per window.
        expected = [2 if mode == "deferred" else 2 * m for m in WINDOWS]
        assert [s["reduce_scatters"] for s in run["steps"]] == expected
        # FSDP1's no_sync holds each unit's whole flat gradient, the frozen base's part included:
        # the layers' every parameter in fp32 (FSDP2 holds the adapters' alone, above).
        held = run["layers_numel"] * 4 if mode == "deferred" else 0
        assert run["plan"]["held_bytes"] == run["stats"]["peak_held_grad_bytes"] == held


def test_tied_embedding_is_counted_once(ranks):
    for rank in ranks:
        run = rank["runs"]["tied_deferred"]
        assert sum(run["units"].values()) == run["trainable_numel"]  # the tied weight once
        assert run["plan"]["held_bytes"] == run["trainable_numel"] * 4
        assert run["stats"]["peak_held_grad_bytes"] == run["plan"]["held_bytes"]


def test_lora_units_are_the_adapters_only(ranks):
    for rank in ranks:
        run = rank["runs"]["lora_deferred"]
        assert run["trainable_names"] and all("lora_" in n for n in run["trainable_names"])
        # The units of frozen embeddings, norm and head reduce nothing: only the layers hold gradients.
        held = sorted(name for name, size in run["units"].items() if size)
        assert held == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
        assert sum(run["units"].values()) == run["trainable_numel"]
        assert run["plan"]["held_bytes"] == run["trainable_numel"] * 4
        assert run["stats"]["peak_held_grad_bytes"] == run["plan"]["held_bytes"]


def test_trainer_with_sync_each_batch_refuses_deferral_before_any_step(ranks):
    for rank in ranks:
        err = rank["trainer_errors"]
        msg = err["sync_each_batch"]
        assert msg.startswith("ValueError"), msg
        assert "sync_each_batch" in msg and "deferred" in msg and "per_micro_batch" in msg
        assert err["written"] == [], err  # nothing in output_dir
        assert err["global_step"] == 0


def test_trainer_windowed_holds_flags_between_micro_batches_and_restores_them_each_step(ranks):
    for rank in ranks:
        run = rank["trainer_windowed"]
        assert run["steps"] == 2
        before = run["before"][0]
        assert len(run["after_step"]) == 2 and all(f == before for f in run["after_step"])
        assert len(run["between"]) == 2 * (M - 1)
        for flags in run["between"]:  # held units: (sync, all-reduce, reshard after backward) all off
            held = [name for name, f in flags.items() if f == [False, False, False]]
            assert held and all(f == [False, False, False] or f == before[name] for name, f in flags.items())
