"""The transformers differences the package and the recipe ask `compat.releases` about: each
answer is checked against the installed transformers itself (its `TrainingArguments` fields, a
real model's forward and output), so every CI stack checks its own release."""

import dataclasses
import inspect

import pytest
import torch
import transformers

from accel_gradsync.compat.releases import kv_cache_name, training_arg, transformers_at_least


@pytest.mark.compat
def test_training_arg_is_a_field_of_this_transformers():
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for name in ("activation_checkpointing", "activation_checkpointing_kwargs", "learning_rate"):
        assert training_arg(name) in fields
    # Before 5.23 only the old name exists; from 5.23 the new one (the old stays an alias).
    expected = "activation_checkpointing" if transformers_at_least("5.23") else "gradient_checkpointing"
    assert training_arg("activation_checkpointing") == expected


@pytest.mark.compat
def test_kv_cache_name_is_what_this_transformers_model_takes_and_returns():
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    assert kv_cache_name() in inspect.signature(model.forward).parameters
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    cache = getattr(out, kv_cache_name())
    assert cache is not None
    out = model(input_ids=torch.tensor([[4]]), use_cache=True, **{kv_cache_name(): cache})
    assert getattr(out, kv_cache_name()).get_seq_length() == 4


@pytest.mark.parametrize(
    ("version", "release", "at_least"),
    [("5.24.0", "5.24", True), ("5.24.0.dev0", "5.24", True), ("5.23.2", "5.24", False), ("5.17.0", "5.23", False)],
)
def test_transformers_at_least_compares_releases(version, release, at_least):
    assert transformers_at_least(release, version) is at_least
    assert kv_cache_name(version) == ("cache" if transformers_at_least("5.24", version) else "past_key_values")
