"""The whole-step peak forecast (estimator/step_peak.py): per row, from the model config alone, on
fake tensors; its flags, its JSON keys (only when asked for), its layer extrapolation, and a
Qwen2-7B config in seconds. Checked against real runs in tests/distributed/test_step_peak_forecast.py."""

import json
import time

import pytest
import torch

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.fake_step import Schedule
from accel_gradsync.estimator.inputs import LoraSpec, StepShape, load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.estimator.step_peak import StepForecaster
from accel_gradsync.planning.units import Plan

SHAPE = StepShape(micro_batch_size=2, seq_len=32)
SMALL = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def recipe_rows(fsdp):
    est = estimate("recipe-default", fsdp(), 4, GradSyncConfig(memory_budget="1GiB"), step_shape=SHAPE)
    return {m.mode.split(" ")[0]: m for m in est.modes}


def test_every_applicable_row_has_a_step_peak_with_its_parts(recipe_rows):
    for row in recipe_rows.values():
        if not row.applicable:
            assert row.step_peak_bytes is None
            continue
        parts = row.step_peak_parts
        assert row.step_peak_bytes >= parts["sharded_params"] + parts["optimizer_state"] + parts["activations"]
        assert row.step_peak_phase in ("first_micro_batch", "later_micro_batch", "optimizer_step")
        assert row.step_peak_unmodeled == []  # no generation: everything is modeled
    per_mb, deferred = recipe_rows["per_micro_batch"], recipe_rows["deferred"]
    # The held row holds unsharded gradients where per_micro_batch keeps sharded ones: it peaks higher.
    assert deferred.step_peak_parts["held_grads"] == deferred.held_bytes
    assert deferred.step_peak_parts["sharded_grads"] == 0
    assert per_mb.step_peak_parts["sharded_grads"] == per_mb.sharded_bytes
    assert deferred.step_peak_bytes > per_mb.step_peak_bytes
    window = recipe_rows["deferred+windowed"]
    assert window.step_peak_bytes >= deferred.step_peak_bytes


def test_adamw_keeps_two_moments_sgd_none(fsdp):
    adamw = estimate("recipe-default", fsdp(), 2, step_shape=SHAPE).mode("per_micro_batch")
    sgd_shape = StepShape(SHAPE.micro_batch_size, SHAPE.seq_len, optimizer="sgd")
    sgd = estimate("recipe-default", fsdp(), 2, step_shape=sgd_shape).mode("per_micro_batch")
    params = adamw.step_peak_parts["sharded_params"]
    assert 2 * params <= adamw.step_peak_parts["optimizer_state"] <= 2 * params + 1024  # + one step scalar per param
    assert sgd.step_peak_parts["optimizer_state"] == 0
    assert adamw.step_peak_bytes > sgd.step_peak_bytes


def _forecaster(fsdp, shape=SHAPE, micro_batches=2):
    return StepForecaster(
        load_model_config(SMALL), torch.float32, read_accelerate_config(fsdp()), GradSyncConfig(), shape, micro_batches
    )


def test_gradient_checkpointing_keeps_fewer_activations(fsdp):
    plain = _forecaster(fsdp, StepShape(4, 64)).simulate(Schedule("per_micro_batch"))
    checkpointed = _forecaster(fsdp, StepShape(4, 64, gradient_checkpointing=True)).simulate(
        Schedule("per_micro_batch")
    )
    assert checkpointed.activations < plain.activations
    assert checkpointed.sharded_params == plain.sharded_params


@pytest.mark.parametrize("held", [False, True], ids=["per_micro_batch", "deferred"])
def test_layer_extrapolation_equals_the_whole_model(fsdp, held):
    """The step of a 4-layer model from its 1- and 2-layer runs is the 4-layer run's, phase by phase."""
    adapter = estimated_adapter(
        build_meta_model(load_model_config(SMALL)), read_accelerate_config(fsdp()), GradSyncConfig()
    )
    plan = Plan("deferred", held=adapter.units) if held else Plan("per_micro_batch")
    extrapolated, whole = _forecaster(fsdp), _forecaster(fsdp)
    whole.layers = None  # run as it is
    peak, exact = extrapolated.row(plan, adapter, plan.mode), whole.row(plan, adapter, plan.mode)
    assert extrapolated.simulated and not peak.unmodeled
    assert peak.phase == exact.phase
    assert peak.peak_bytes == pytest.approx(exact.peak_bytes, rel=0.01)
    assert peak.parts["sharded_params"] == exact.parts["sharded_params"]


@pytest.mark.slow  # the 7B timing claim; the parts it checks are the small models' above too
def test_qwen2_7b_takes_seconds(fsdp, qwen2_7b):
    began = time.perf_counter()
    est = estimate(qwen2_7b, fsdp(mixed_precision="bf16"), 4, step_shape=StepShape(4, 512))
    seconds = time.perf_counter() - began
    assert seconds < 60, seconds  # about 12 s on 2 shared CPU cores
    per_mb = est.mode("per_micro_batch")
    params = est.params
    # fp32 sharded params (accelerate upcasts under mixed precision), AdamW: 2 fp32 moments.
    assert per_mb.step_peak_parts["sharded_params"] == pytest.approx(params * 4 / 2, rel=0.01)
    assert per_mb.step_peak_parts["optimizer_state"] == pytest.approx(params * 8 / 2, rel=0.01)
    assert per_mb.step_peak_parts["activations"] > 2**30  # bf16 activations of 2048 tokens, 28 layers


def test_json_has_step_peak_only_when_asked(good, capsys, clean_env):
    main(["estimate", "--accelerate-config", good, "--micro-batches", "2", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert "step_shape" not in plain and all("step_peak_bytes" not in row for row in plain["modes"])
    main(
        [
            "estimate",
            "--accelerate-config",
            good,
            "--micro-batches",
            "2",
            "--json",
            "--micro-batch-size",
            "2",
            "--seq-len",
            "32",
        ]
    )
    forecast = json.loads(capsys.readouterr().out)
    assert forecast["step_shape"] == {
        "micro_batch_size": 2,
        "seq_len": 32,
        "optimizer": "adamw",
        "gradient_checkpointing": False,
        "max_completion_length": 0,
        "num_generations": 0,
    }
    assert all(isinstance(row["step_peak_bytes"], int) for row in forecast["modes"] if row["applicable"])


def test_table_has_the_step_peak_column_only_when_asked(good, capsys, clean_env):
    main(["estimate", "--accelerate-config", good, "--micro-batches", "2"])
    assert "step peak/rank" not in capsys.readouterr().out
    main(
        ["estimate", "--accelerate-config", good, "--micro-batches", "2", "--micro-batch-size", "2", "--seq-len", "32"]
    )
    out = capsys.readouterr().out
    assert "step peak/rank" in out.splitlines()[2]
    assert "(later_micro_batch)" in out


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--micro-batch-size", "4"], "--seq-len"),
        (["--seq-len", "512"], "--micro-batch-size"),
        (["--optimizer", "sgd"], "--optimizer sgd"),
        (["--gradient-checkpointing"], "--gradient-checkpointing"),
        (["--micro-batch-size", "0", "--seq-len", "8"], "--micro-batch-size=0"),
        (["--micro-batch-size", "2", "--seq-len", "-3"], "--seq-len=-3"),
        (["--max-completion-length", "8"], "--max-completion-length 8"),
        (["--micro-batch-size", "2", "--seq-len", "8", "--max-completion-length", "8"], "--max-completion-length=8"),
        (["--micro-batch-size", "2", "--seq-len", "32", "--num-generations", "4"], "--num-generations=4"),
        (
            ["--micro-batch-size", "2", "--seq-len", "32", "--max-completion-length", "8", "--num-generations", "3"],
            "--num-generations=3",
        ),
    ],
)
def test_bad_forecast_flags_get_one_line(cli_error, good, capsys, clean_env, args, names):
    line = cli_error(capsys, "--accelerate-config", good, *args)
    assert names in line and ("pass" in line or "needs" in line), line


def test_fsdp1_is_refused_with_what_to_pass(cli_error, tmp_path, capsys, clean_env, good_text):
    path = tmp_path / "fsdp1.yaml"
    path.write_text(good_text.replace("fsdp_version: 2", "fsdp_version: 1"))
    line = cli_error(capsys, "--accelerate-config", str(path), "--micro-batch-size", "2", "--seq-len", "8")
    assert "FSDPMemTracker" in line and "fsdp_version: 2" in line, line


def test_hsdp_is_refused_with_what_to_pass(fsdp):
    with pytest.raises(ValueError, match=r"HSDP .* --num-processes 2\.$"):
        estimate("recipe-default", fsdp(processes=4, replicate=2), 2, step_shape=SHAPE)


@pytest.mark.slow  # against real generate(): tests/distributed/test_step_peak_forecast.py, default suite
def test_generation_phase_holds_the_kv_cache_of_the_generation_batch(fsdp):
    """GRPO's generation (`--max-completion-length`): twice the tokens per sequence add about one
    KV cache of the extra tokens (2 x layers x kv heads x head dim x fp32 per token) for the
    micro-batch-size x micro-batches sequences one rank generates; gathered units add the
    unsharded params. The row's phases include it, and nothing is marked unmodeled."""
    short = _forecaster(fsdp, StepShape(2, 32, max_completion_length=16))
    long = _forecaster(fsdp, StepShape(2, 64, max_completion_length=32))
    grown = long.simulate_generation(False) - short.simulate_generation(False)
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    per_token = 2 * SMALL["num_hidden_layers"] * SMALL["num_key_value_heads"] * head_dim * 4
    kv_cache = 2 * 2 * 32 * per_token  # 4 sequences x 32 more tokens
    # Less than a whole cache where the shorter run peaks in its prefill; more with the cache copy decoding makes.
    assert 0.8 * kv_cache <= grown <= 1.5 * kv_cache, (grown, kv_cache)
    assert short.simulate_generation(True) > short.simulate_generation(False)
    adapter = estimated_adapter(
        build_meta_model(load_model_config(SMALL)), read_accelerate_config(fsdp()), GradSyncConfig()
    )
    peak = short.row(Plan("per_micro_batch"), adapter, "per_micro_batch")
    assert peak.parts["generation_peak"] == short.simulate_generation(False) and not peak.unmodeled


def test_a_lora_fine_tune_trains_and_holds_only_its_adapters(fsdp, recipe_rows):
    lora = estimate(
        "recipe-default", fsdp(), 4, GradSyncConfig(memory_budget="1GiB"), step_shape=SHAPE, lora=LoraSpec(8)
    )
    full = recipe_rows["per_micro_batch"]
    adapters = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)  # per layer q_proj (64 -> 64) and v_proj (64 -> 32), rank 8
    assert lora.params == adapters and full.sharded_bytes > 10 * 4 * lora.params / 2
    row, full_row = lora.mode("deferred"), recipe_rows["deferred"]
    assert row.held_bytes == 4 * lora.params  # fp32 gradients of the adapters only
    # AdamW's two fp32 moments of this rank's half of the adapters; the frozen base has none.
    assert row.step_peak_parts["optimizer_state"] <= 4 * lora.params + 1024
    # The frozen base stays sharded as in full fine-tuning; the adapters add their own half per rank.
    assert row.step_peak_parts["sharded_params"] == full_row.step_peak_parts["sharded_params"] + 4 * lora.params // 2
    assert row.step_peak_bytes < full_row.step_peak_bytes


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--lora-target-modules", "q_proj"], "--lora-target-modules='q_proj'"),
        (["--lora-r", "0"], "--lora-r=0"),  # given is given: 0 is no rank, not "full fine-tuning"
        (["--lora-r", "-2"], "--lora-r=-2"),
        (["--lora-r", "4", "--lora-target-modules", "no_such_proj"], "--lora-target-modules"),
    ],
)
def test_bad_lora_flags_get_one_line(cli_error, good, capsys, clean_env, args, names):
    line = cli_error(capsys, "--accelerate-config", good, *args)
    assert names in line, line
