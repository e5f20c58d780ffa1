"""`estimator.meta_model`: the units accelerate gives for each wrap policy, read by the runtime's
adapters from a model sharded without memory, and the layer class to set where accelerate cannot
wrap a model."""

import pytest
from torch._subclasses.fake_tensor import FakeTensor

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.runtime.wrappers.fsdp1 import FSDP1Adapter
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning"),
]


def test_units_are_read_by_the_runtime_adapters_from_a_model_sharded_without_memory(fsdp):
    """FSDP2 shards stay on the meta device; FSDP1's flat parameters are fake tensors (no storage)."""
    config = GradSyncConfig()
    fsdp2 = estimated_adapter(
        build_meta_model(load_model_config("recipe-default")),
        read_accelerate_config(fsdp(2, processes=4, replicate=2)),
        config,
    )
    assert type(fsdp2) is FSDP2Adapter and fsdp2.hsdp
    assert all(p.is_meta for p in fsdp2.model.parameters())
    assert {u.shard_size for u in fsdp2.units} == {2}  # 2 replicas x 2 shards: sharded over 2
    fsdp1 = estimated_adapter(
        build_meta_model(load_model_config("recipe-default")), read_accelerate_config(fsdp(1, processes=4)), config
    )
    assert type(fsdp1) is FSDP1Adapter and fsdp1.root_only
    assert all(isinstance(p, FakeTensor) for p in fsdp1.model.parameters())
    assert {u.shard_size for u in fsdp1.units} == {4}
    assert sum(u.numel for u in fsdp1.units) == sum(u.numel for u in fsdp2.units)


def test_wrap_policies_give_the_units_accelerate_gives(fsdp, qwen2_7b):
    small = dict(
        qwen2_7b,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    layer = 4 * 64 * 64 // 2 + 64 + 2 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q,k,v(+bias),o, mlp, norms
    no_wrap = estimate(small, fsdp(1, fsdp_auto_wrap_policy="NO_WRAP"), 2)
    assert [u["name"] for u in no_wrap.units] == ["<root>"]
    fsdp1 = estimate(small, fsdp(1), 2)  # _no_split_modules: Qwen2DecoderLayer
    layers = [f"_fsdp_wrapped_module.model.layers.{i}" for i in range(3)]  # FSDP1's module names
    assert [u["name"] for u in fsdp1.units] == ["<root>", *layers]
    assert fsdp1.units[1]["numel"] == layer
    fsdp2 = estimate(small, fsdp(2), 2)
    # The untied input embedding, the layers, and [model.norm, lm_head] (named by its first module).
    assert [u["name"] for u in fsdp2.units] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
    ]
    assert fsdp2.units[-1]["numel"] == 64 + 100 * 64
    size = estimate(small, fsdp(1, fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=layer - 1), 2)
    assert len(size.units) >= 4
    assert no_wrap.params == fsdp1.params == fsdp2.params == size.params


def test_a_model_accelerate_cannot_wrap_names_the_layer_class_to_set(good_text, cli_error, good, tmp_path, capsys):
    """A BERT under TRANSFORMER_BASED_WRAP without a layer class: accelerate wraps the model's
    `_no_split_modules` (its embeddings too) and `fully_shard` refuses the overlap. The line names
    the setting and the model's repeated layer class, and that setting then works."""
    from transformers import BertConfig, BertForMaskedLM

    model = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(model)  # random weights; the estimate reads config.json only
    line = cli_error(capsys, "--accelerate-config", good, "--model", str(model))
    assert "fsdp_transformer_layer_cls_to_wrap: BertLayer" in line, line
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(good_text + "  fsdp_transformer_layer_cls_to_wrap: BertLayer\n")
    assert main(["estimate", "--micro-batches", "2", "--accelerate-config", str(fixed), "--model", str(model)]) == 0
    assert "2 micro-batches per optimizer step" in capsys.readouterr().out


def test_a_lora_fine_tune_under_fsdp1_names_use_orig_params(good_text, cli_error, tmp_path, capsys):
    """FSDP1 flattens each unit's parameters into one tensor, all trainable or all frozen; a LoRA
    unit mixes both, so accelerate cannot shard it without `fsdp_use_orig_params: true`. The line
    names that setting (not the layer class, which accelerate already wraps), and it then works."""
    fsdp1 = good_text.replace("fsdp_version: 2", "fsdp_version: 1")
    plain, fixed = tmp_path / "fsdp1.yaml", tmp_path / "fixed.yaml"
    plain.write_text(fsdp1)
    fixed.write_text(fsdp1 + "  fsdp_use_orig_params: true\n")
    line = cli_error(capsys, "--accelerate-config", str(plain), "--lora-r", "4")
    assert "Set fsdp_use_orig_params: true" in line and "fsdp_transformer_layer_cls_to_wrap" not in line, line
    assert main(["estimate", "--micro-batches", "2", "--accelerate-config", str(fixed), "--lora-r", "4"]) == 0
    assert "2 micro-batches per optimizer step" in capsys.readouterr().out
