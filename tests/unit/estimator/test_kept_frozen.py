"""`keep_frozen_unsharded` in the estimate: a LoRA model's rows split and keep as a live prepare
does (the runtime's own `FrozenResidency` over the meta model), every expected value computed here
from the model config's shapes. (Against a live run: tests/distributed/test_estimate_vs_measured.py.)

A tiny Qwen2 (hidden 32, 4 heads of 8, 2 KV heads, MLP 64, vocabulary 128 tied to the head), LoRA
r=8 on q_proj and v_proj, FSDP2 over 2 ranks, decoder layers as units, fp32."""

import json

import pytest
import torch

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.fake_step import Schedule, unit_key
from accel_gradsync.estimator.formatting import format_table
from accel_gradsync.estimator.inputs import LoraSpec, StepShape, load_model_config, read_accelerate_config
from accel_gradsync.estimator.step_peak import StepForecaster

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")

HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, R, M = 32, 4, 2, 64, 128, 8, 2
KV = KV_HEADS * HIDDEN // HEADS  # k_proj and v_proj's outputs: 2 heads of 8


def tiny(layers: int = 2) -> dict:
    return dict(
        model_type="qwen2",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


# One decoder layer's frozen base: q, k, v (weights and biases), o (no bias), gate, up, down, two norms.
LAYER = (HIDDEN * HIDDEN + HIDDEN) + 2 * (KV * HIDDEN + KV) + HIDDEN * HIDDEN + 3 * MLP * HIDDEN + 2 * HIDDEN
EMBED, NORM = VOCAB * HIDDEN, HIDDEN  # the tied embedding (its own unit), the final norm (the root's)
ADAPTERS = (R * HIDDEN + HIDDEN * R) + (R * HIDDEN + KV * R)  # one layer's: q's A and B, v's A and B
LORA = LoraSpec(R, ("q_proj", "v_proj"))
PREFIX = "base_model.model.model"
KEPT_NAMES = ["<root>", f"{PREFIX}.embed_tokens", f"{PREFIX}.layers.0", f"{PREFIX}.layers.1"]


def test_the_hand_counts_are_the_configs():
    assert LAYER == 9344 and ADAPTERS == 896  # 12 base tensors; A: r x in, B: out x r


def _estimate(fsdp, layers=2, mixed_precision="no", step_shape=None, **config):
    return estimate(
        tiny(layers), fsdp(2, mixed_precision), M, GradSyncConfig(**config), step_shape=step_shape, lora=LORA
    )


@pytest.fixture(scope="module")
def kept(fsdp):
    return _estimate(fsdp, keep_frozen_unsharded=True)


def test_true_keeps_the_whole_frozen_base_in_every_row(kept):
    for row in (m for m in kept.modes if m.applicable):
        assert row.resident_units == KEPT_NAMES, row.mode
        assert (row.units_resident, row.resident_param_bytes) == (4, (NORM + EMBED + 2 * LAYER) * 4), row.mode
        assert row.resident_dtype == "fp32"
    # Split as the live prepare splits: each layer's adapters a unit of its own, the only trainable ones.
    assert kept.params == 2 * ADAPTERS and len(kept.units) == 4 + 2
    assert sorted(u["numel"] for u in kept.units) == [0, 0, 0, 0, ADAPTERS, ADAPTERS]


def test_the_base_is_gathered_in_step_1_only_and_each_step_gathers_the_adapters(kept):
    row = kept.mode("per_micro_batch")
    # Each adapter unit in each micro-batch's forward and backward (it reshards after forward).
    assert row.all_gathers == 2 * M * 2 and row.first_step_all_gathers == row.all_gathers + 4
    assert row.all_gather_bytes == row.all_gathers * ADAPTERS * 4 // 2  # ring over 2 ranks: half of each
    window = kept.mode("deferred+windowed")  # the adapters once per step
    assert (window.all_gathers, window.first_step_all_gathers) == (2, 6)


def test_false_and_auto_outside_budget_auto_and_windowed_keep_nothing_and_split_nothing(fsdp):
    for config in ({"keep_frozen_unsharded": False}, {}):
        est = _estimate(fsdp, **config)
        assert len(est.units) == 4, config  # root, embeddings, two layers holding base and adapters
        for row in (m for m in est.modes if m.applicable and (config or m.mode != "deferred+windowed")):
            assert (row.units_resident, row.resident_param_bytes, row.resident_units) == (0, 0, []), row.mode
            assert row.first_step_all_gathers == row.all_gathers
    assert est.keep_frozen_unsharded == "auto"


def test_auto_with_every_unit_windowed_keeps_the_whole_frozen_base(fsdp):
    """Deferral with every unit windowed holds every unit's params through the step anyway: auto
    keeps every frozen unit there, in its row whatever is selected, and in the header selected."""
    for config in ({}, {"sync_mode": "deferred", "keep_params_unsharded": True}):
        est = _estimate(fsdp, **config)
        window = est.mode("deferred+windowed")
        assert window.resident_units == KEPT_NAMES, config
        assert window.resident_param_bytes == (NORM + EMBED + 2 * LAYER) * 4
        assert (window.all_gathers, window.first_step_all_gathers) == (2, 6)  # the adapters once per step
        assert est.mode("deferred").units_resident == 0
    assert len(est.units) == 4 + 2  # selected: split as the live prepare splits


def test_auto_under_budget_keeps_in_model_order_what_fits(fsdp):
    """The root, the embeddings and layer 0 fit 60,000 B; layer 1 would not. A budget no decoder
    layer fits leaves the model as accelerate shards it (nothing split)."""
    fits = (NORM + EMBED + LAYER) * 4
    assert fits <= 60_000 < fits + LAYER * 4
    est = _estimate(fsdp, sync_mode="budget", memory_budget="60000B")
    row = next(m for m in est.modes if m.mode.startswith("budget"))
    assert row.resident_units == KEPT_NAMES[:3] and row.resident_param_bytes == fits
    assert est.mode("per_micro_batch").units_resident == 0
    none = _estimate(fsdp, sync_mode="budget", memory_budget="100B")
    budget = next(m for m in none.modes if m.mode.startswith("budget"))
    assert budget.units_resident == 0 and len(none.units) == 4


def test_auto_mode_needs_free_memory_to_decide_and_its_row_says_so(fsdp):
    est = _estimate(fsdp, sync_mode="auto")
    row = next(m for m in est.modes if m.mode.startswith("auto"))
    assert not row.applicable and "--grad-sync-free-memory" in row.reason
    assert len(est.units) == 4  # the header: the model unsplit, its decision left to the row
    kept = _estimate(fsdp, sync_mode="auto", free_memory="1GiB")
    assert next(m for m in kept.modes if m.mode.startswith("auto")).resident_units == KEPT_NAMES


def test_under_bf16_the_kept_copy_is_bf16(fsdp):
    row = _estimate(fsdp, mixed_precision="bf16", keep_frozen_unsharded=True).mode("per_micro_batch")
    assert (row.resident_dtype, row.resident_param_bytes) == ("bf16", (NORM + EMBED + 2 * LAYER) * 2)


def test_one_process_keeps_nothing(fsdp):
    est = estimate(tiny(), fsdp(2, processes=1), M, GradSyncConfig(keep_frozen_unsharded=True), lora=LORA)
    assert all(m.units_resident == 0 for m in est.modes if m.applicable)  # attach does nothing


def test_the_step_peak_holds_the_kept_base_in_every_phase(fsdp):
    """The simulated step with the base kept: the optimizer step, where nothing else is gathered,
    holds exactly the kept bytes more, every phase more; the row's peak is that step's, its parts
    name them."""
    forecaster = StepForecaster(
        load_model_config(tiny()),
        torch.float32,
        read_accelerate_config(fsdp()),
        GradSyncConfig(),
        StepShape(1, 16),
        M,
        LORA,
    )
    kept_names = frozenset("" if n == "<root>" else n for n in KEPT_NAMES)
    plain = forecaster.simulate(Schedule("per_micro_batch"))
    kept = forecaster.simulate(Schedule("per_micro_batch", resident=kept_names))
    assert kept.phases["optimizer_step"] - plain.phases["optimizer_step"] == (NORM + EMBED + 2 * LAYER) * 4
    assert all(kept.phases[p] > plain.phases[p] for p in plain.phases)
    row = _estimate(fsdp, step_shape=StepShape(1, 16), keep_frozen_unsharded=True).mode("per_micro_batch")
    assert row.step_peak_bytes == max(kept.phases.values()) and not row.step_peak_unmodeled
    assert row.step_peak_parts["resident_params"] == (NORM + EMBED + 2 * LAYER) * 4


@pytest.mark.slow  # two more simulated models (1 and 2 layers)
def test_four_layers_are_extrapolated_with_the_kept_base(fsdp):
    shape = StepShape(1, 16)
    row = _estimate(fsdp, layers=4, step_shape=shape, keep_frozen_unsharded=True).mode("per_micro_batch")
    assert row.resident_param_bytes == (NORM + EMBED + 4 * LAYER) * 4 and not row.step_peak_unmodeled
    partial = _estimate(fsdp, layers=4, step_shape=shape, sync_mode="budget", memory_budget="60000B")
    budget = next(m for m in partial.modes if m.mode.startswith("budget"))
    assert budget.units_resident == 3 and "kept frozen" in " ".join(budget.step_peak_unmodeled)


def test_unit_key_names_a_layers_adapter_unit_alike_in_every_layer():
    assert unit_key("model.layers.7") == "model.layers.*"
    assert unit_key(f"{PREFIX}.layers.3.self_attn.q_proj.lora_A.default") == (
        f"{PREFIX}.layers.*.self_attn.q_proj.lora_A.default"
    )
    assert unit_key("model.embed_tokens") == "model.embed_tokens"


def test_the_table_names_the_kept_units_and_the_json_counts_them(kept, fsdp):
    text = format_table(kept)
    header = text.splitlines()[1]
    assert header.startswith("grad sync: keep_frozen_unsharded=true: per_micro_batch keeps ~89.1 KiB unsharded fp32")
    assert f"of 4 frozen units for the run (<root>, {PREFIX}.embed_tokens, {PREFIX}.layers.0-1)" in header
    assert "kept frozen/rank" in text and "4 (89.1 KiB)" in text
    assert f"per_micro_batch: keeps <root>, {PREFIX}.embed_tokens, {PREFIX}.layers.0-1; step 1 all-gathers 12" in text
    row = kept.to_dict()["modes"][0]
    assert (row["units_resident"], row["resident_param_bytes"], row["first_step_all_gathers"]) == (4, 91264, 12)
    # Without frozen units to keep (full fine-tuning), no resident key: the JSON it was.
    full = estimate(tiny(), fsdp(), M, GradSyncConfig(keep_frozen_unsharded=True)).to_dict()
    assert "keep_frozen_unsharded" not in full and "units_resident" not in full["modes"][0]
    assert "kept frozen" not in format_table(estimate(tiny(), fsdp(), M, GradSyncConfig()))


def test_the_cli_models_it_and_says_nothing_on_stderr(good, capsys):
    args = ["estimate", "--micro-batches", "2", "--accelerate-config", good, "--lora-r", "8", "--keep_frozen_unsharded"]
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr()
    assert "not modelled" not in out.err + out.out
    # recipe-default's base: layers of hidden 64 (q 64x64+64, k and v 32x64+32, o 64x64, MLP 3 x 64x128,
    # two norms), the tied embedding 17 x 64 and the final norm: 301,568 B in fp32.
    layer = (64 * 64 + 64) + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    rows = json.loads(out.out)["modes"]
    assert rows[0]["resident_param_bytes"] == (2 * layer + 17 * 64 + 64) * 4 == 301_568


def test_under_use_vllm_true_is_refused_and_auto_keeps_nothing_as_attach_decides(fsdp):
    """TRL's use_vllm merges the adapter into the sharded base between steps: the live attach
    refuses true and keeps nothing under auto (tests/distributed/test_frozen_units.py), and so does
    the estimate. Under auto with room for the whole base, every row then gathers the base every
    step, as the rows without the setting do."""
    with pytest.raises(ValueError, match="keep_frozen_unsharded=true with use_vllm=true") as err:
        estimate(tiny(), fsdp(), M, GradSyncConfig(keep_frozen_unsharded=True), lora=LORA, use_vllm=True)
    assert "\n" not in str(err.value)
    config = GradSyncConfig(sync_mode="auto", free_memory="1GiB")
    kept = estimate(tiny(), fsdp(), M, config, lora=LORA)
    assert next(m for m in kept.modes if m.mode.startswith("auto")).resident_units == KEPT_NAMES  # room for all
    vllm = estimate(tiny(), fsdp(), M, config, lora=LORA, use_vllm=True)
    assert len(vllm.units) == 4  # nothing split from the base
    for row in (m for m in vllm.modes if m.applicable):
        assert (row.units_resident, row.resident_units) == (0, []), row.mode
        assert row.first_step_all_gathers == row.all_gathers, row.mode
    header = format_table(vllm).splitlines()[1]
    assert header.startswith("grad sync: keep_frozen_unsharded=auto: auto") and "use_vllm" in header, header
    assert vllm.to_dict()["use_vllm"] is True and "use_vllm" not in kept.to_dict()


def test_under_use_vllm_the_step_peak_has_no_generation_phase(fsdp):
    """vLLM generates, not the trained model: no generation phase, whatever the completion length
    (the row says what it leaves out), and the training phases are those without generation."""
    shape = StepShape(1, 16, max_completion_length=8)
    generating = _estimate(fsdp, step_shape=shape).mode("per_micro_batch")
    assert generating.step_peak_parts.get("generation_peak")  # the trained model generates
    vllm = estimate(tiny(), fsdp(), M, GradSyncConfig(), step_shape=shape, lora=LORA, use_vllm=True)
    row = vllm.mode("per_micro_batch")
    assert "generation_peak" not in row.step_peak_parts and row.step_peak_phase != "generation"
    assert any("vLLM's generation" in note for note in row.step_peak_unmodeled), row.step_peak_unmodeled
    plain = _estimate(fsdp, step_shape=StepShape(1, 16)).mode("per_micro_batch")
    assert row.step_peak_bytes == plain.step_peak_bytes  # the training step alone


def test_the_cli_reads_use_vllm(good, capsys):
    args = ["estimate", "--micro-batches", "2", "--accelerate-config", good, "--lora-r", "8", "--json"]
    assert main([*args, "--use-vllm", "--grad-sync-mode", "auto", "--grad-sync-free-memory", "1GiB"]) == 0
    rows = json.loads(capsys.readouterr().out)["modes"]
    assert all(row["units_resident"] == 0 for row in rows if row["applicable"])
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--use-vllm", "--keep_frozen_unsharded"])
    assert exit_.value.code == 2
    assert "keep_frozen_unsharded=true with use_vllm=true" in capsys.readouterr().out
