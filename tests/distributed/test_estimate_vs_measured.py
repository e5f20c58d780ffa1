"""`accel_gradsync.estimator.core` against real 2-rank gloo runs: for the
recipe's default model and a ~10M-parameter Qwen2, FSDP1 and FSDP2, without and with bf16
mixed precision (FSDP2 also with an fp32 reduce, the 4-bytes-per-param case), the estimated
held bytes are within 2% of the bytes FSDP really holds between micro-batches, in the
estimated dtype, and the estimated reduce-scatters (FSDP2: and all-gathers) per optimizer step
equal the real ones
(in the second optimizer step: the estimate describes the steady state).

One launch per (FSDP version, mixed precision), each running both models in both modes; one more
for a LoRA fine-tune with `keep_frozen_unsharded` (the workers/frozen_units.py runs): the frozen
units the estimate keeps resident, their bytes and the all-gathers of step 1 and after are the
live run's."""

import json

import pytest
from launcher import accelerate_config, launch
from workers.common import tiny_qwen2_config

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.inputs import LoraSpec

M = 2
# ~10M parameters, untied embeddings: FSDP2 then carves the input embedding into its own unit.
SMALL = dict(
    model_type="qwen2",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
MODELS = ["recipe-default", SMALL]
RUNS = {  # id: (fsdp version, mixed precision, reduce dtypes); FSDP2 also runs the window
    "fsdp1-fp32": ("fsdp1", "no", "auto"),
    "fsdp1-bf16": ("fsdp1", "bf16", "auto"),
    "fsdp2-fp32": ("fsdp2", "no", "auto"),
    "fsdp2-bf16": ("fsdp2", "bf16", "auto,fp32"),
}
_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _config(kind: str, mixed_precision: str) -> dict:
    config = accelerate_config(kind, fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
    config["mixed_precision"] = mixed_precision  # the top-level key accelerate launch reads
    return config


QUICK = ("fsdp2-fp32",)  # the default suite; every run with --slow


@pytest.fixture(scope="module", params=[pytest.param(k, marks=() if k in QUICK else pytest.mark.slow) for k in RUNS])
def run(request):
    kind, mixed_precision, reduce_dtypes = RUNS[request.param]
    config = _config(kind, mixed_precision)
    modes = "per_micro_batch,deferred" + (",deferred+windowed" if kind == "fsdp2" else "")
    args = ["--models", json.dumps(MODELS), "--M", str(M), "--reduce-dtypes", reduce_dtypes, "--modes", modes]
    ranks = launch("held_bytes", args, config)
    estimates = {}
    for result in ranks[0]["results"]:
        key = (json.dumps(result["model"]), result["reduce_dtype"])
        if key not in estimates:
            estimates[key] = estimate(result["model"], config, M, GradSyncConfig(reduce_dtype=result["reduce_dtype"]))
    return kind, ranks, estimates


def _rows(run):
    kind, ranks, estimates = run
    for rank in ranks:
        for result in rank["results"]:
            est = estimates[(json.dumps(result["model"]), result["reduce_dtype"])]
            yield result, est, est.mode(result["mode"])


@pytest.mark.compat
def test_held_bytes_within_two_percent_in_the_estimated_dtype(run):
    checked = 0
    for result, est, row in _rows(run):
        if result["mode"] != "deferred":
            continue
        assert len(result["held"]) == M - 1  # measured after every micro-batch but the last
        for held in result["held"]:
            assert held["bytes"] > 0
            assert abs(row.held_bytes - held["bytes"]) <= 0.02 * held["bytes"], (est.model, row, held)
            assert held["dtypes"] == [_DTYPE[row.held_dtype]], (est.model, row.held_dtype, held)
        checked += 1
    assert checked >= 2


def test_windowed_held_params_and_gradients_are_exact(run):
    """The window row's held gradient and held parameter bytes are the tensors' bytes."""
    kind, _, _ = run
    if kind != "fsdp2":
        pytest.skip("the window is FSDP2's")
    checked = 0
    for result, est, row in _rows(run):
        if result["mode"] != "deferred+windowed":
            continue
        assert len(result["held"]) == M - 1
        for held in result["held"]:
            assert (held["bytes"], held["param_bytes"]) == (row.held_bytes, row.held_param_bytes), (
                est.model,
                row,
                held,
            )
            assert held["dtypes"] == [_DTYPE[row.held_dtype]]
        checked += 1
    assert checked >= 2


@pytest.mark.compat
def test_collective_counts_per_step_are_exact(run):
    for result, est, row in _rows(run):
        counts = result["counts"]
        reduce_scatters = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
        assert reduce_scatters == row.reduce_scatters, (est.model, result["mode"], counts, row)
        assert counts.get("all_reduce", 0) == row.all_reduces == 0  # a 1-D mesh: no HSDP all-reduce
        if est.wrapper == "fsdp2":  # FSDP1's all-gathers bypass the wrapped torch.distributed functions
            assert counts.get("all_gather_single", 0) + counts.get("all_gather_into_tensor", 0) == row.all_gathers


def test_deferral_saves_what_the_estimate_says(run):
    for result, est, row in _rows(run):
        per_mb = est.mode("per_micro_batch")
        assert per_mb.reduce_scatters == M * len(est.units)
        if result["mode"] == "deferred":
            assert row.reduce_scatters == len(est.units)
            assert per_mb.send_bytes == M * row.send_bytes


def test_runtime_counters_agree_with_the_estimate(run):
    """The handle's own counters (adapter.py's units) against the estimate's. FSDP2: accelerate
    shards [final norm, lm_head(, tied embedding)] in one `fully_shard` call, so several
    modules share one FSDP state and count as one unit."""
    mismatches = []
    for result, est, row in _rows(run):
        issued, held = result["stats"]["last_step/reduce_scatters_issued"], result["stats"]["last_step/held_grad_bytes"]
        if issued != row.reduce_scatters:
            mismatches.append((est.model, result["mode"], "reduce_scatters", issued, row.reduce_scatters))
        if result["mode"] in ("deferred", "deferred+windowed") and held != row.held_bytes:
            mismatches.append((est.model, result["mode"], "held", held, row.held_bytes))
    assert not mismatches


def test_units_are_the_runs_units_by_name_size_and_order(run):
    """The estimate reads its units with the run's own adapter from a model sharded by
    accelerate's own code, so they are the run's units: the names of its `unit_modes`, in order,
    and (deferred: every unit held) the same sizes."""
    checked = 0
    for result, est, _ in _rows(run):
        names = ["" if u["name"] == "<root>" else u["name"] for u in est.units]
        assert list(result["stats"]["unit_modes"]) == names, (est.model, result["mode"])
        if result["mode"] == "deferred":
            sizes = [(u["name"], u["numel"]) for u in result["units"]]
            assert sizes == [(n, u["numel"]) for n, u in zip(names, est.units, strict=True)], est.model
            checked += 1
    assert checked >= 2


# workers/frozen_units.py's model, from the function it is built with; LoRA r=4 on q_proj and v_proj.
LORA_MODEL = tiny_qwen2_config(vocab_size=32, pad_token_id=0).to_dict()
LORA_RUNS = {  # run name: (its GradSyncConfig, the estimate's row)
    "keep": ({"keep_frozen_unsharded": True}, "per_micro_batch"),
    "budget": ({"sync_mode": "budget", "memory_budget": "1MiB"}, "budget"),  # auto: kept as the budget allows
}


@pytest.fixture(scope="module")
def lora_ranks():
    runs = [{"name": name, "config": config} for name, (config, _) in LORA_RUNS.items()]
    return launch("frozen_units", ["--M", str(M), "--runs", json.dumps(runs)], _config("fsdp2", "no"))


def test_lora_kept_frozen_units_and_their_all_gathers_are_the_live_runs(lora_ranks):
    """keep_frozen_unsharded: the units (split as the live prepare splits them), the kept ones and
    their bytes (stats()), step 1's all-gathers (the kept units once) and every later step's (the
    adapters only), and the bytes those gather (ring: half of the gathered outputs over 2 ranks)."""
    for name, (config, mode) in LORA_RUNS.items():
        est = estimate(
            LORA_MODEL, _config("fsdp2", "no"), M, GradSyncConfig(**config), lora=LoraSpec(4, ("q_proj", "v_proj"))
        )
        row = est.mode(mode)
        assert row.units_resident > 0, (name, row)
        for rank in lora_ranks:
            live = rank["runs"][name]
            assert ["" if u["name"] == "<root>" else u["name"] for u in est.units] == list(live["units"]), name
            assert (row.units_resident, row.resident_param_bytes) == (
                live["stats"]["units_resident"],
                live["stats"]["resident_param_bytes"],
            ), name
            assert row.first_step_all_gathers == live["steps"][0]["all_gathers"], (name, live["steps"])
            for step in live["steps"][1:]:
                assert (row.all_gathers, 2 * row.all_gather_bytes) == (step["all_gathers"], step["gathered_bytes"]), (
                    name,
                    step,
                )
