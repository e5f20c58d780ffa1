"""`LiveForecaster`'s parts that need no run (estimator/live.py): what it reads of a live model and
plugin, and the child's forecast itself, computed here in-process from a spec as the child gets it
(the whole path, child process and broadcast, runs in tests/distributed/test_forecast_auto.py)."""

import functools

import pytest
import torch
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.inputs import RECIPE_DEFAULT_MODEL, LoraSpec, StepShape, load_model_config
from accel_gradsync.estimator.live import _lora_of, _wrap_policy_name, forecast_unheld_step

LAUNCH = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "mixed_precision": "no",
    "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
}


def _spec(lora=None):
    settings = GradSyncConfig(sync_mode="auto", forecast_micro_batch_size=2, forecast_seq_len=32).resolved()
    return {
        "model_config": "recipe-default",
        "model_dtype": "fp32",
        "accelerate_config": LAUNCH,
        "lora": lora,
        "settings": vars(settings),
        "shape": {"micro_batch_size": 2, "seq_len": 32, "optimizer": "adamw", "gradient_checkpointing": False},
        "micro_batches": 4,
    }


def test_the_child_forecasts_the_per_micro_batch_step_as_the_estimate_does():
    answer = forecast_unheld_step(_spec())
    est = estimate("recipe-default", LAUNCH, 4, GradSyncConfig(sync_mode="auto"), step_shape=StepShape(2, 32))
    assert answer["peak_bytes"] == est.mode("per_micro_batch").step_peak_bytes
    assert answer["unmodeled"] == [] and answer["shape"].startswith("2x32 tokens per micro-batch, adamw")


@pytest.mark.slow  # a second forecast; the LoRA forecast itself is in test_step_peak.py
def test_the_child_forecasts_a_lora_model_with_its_adapters():
    answer = forecast_unheld_step(_spec())
    lora = forecast_unheld_step(_spec({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    assert lora["peak_bytes"] < answer["peak_bytes"] and "LoRA r=8" in lora["shape"]
    lora_est = estimate(
        "recipe-default", LAUNCH, 4, step_shape=StepShape(2, 32), lora=LoraSpec(8, ("q_proj", "v_proj"))
    )
    assert lora["peak_bytes"] == lora_est.mode("per_micro_batch").step_peak_bytes


def test_a_lora_model_is_read_and_other_peft_methods_are_refused_with_why():
    from peft import IA3Config, LoraConfig, get_peft_model

    config = load_model_config(dict(RECIPE_DEFAULT_MODEL))
    assert _lora_of(AutoModelForCausalLM.from_config(config)) == (None, "")
    lora = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, task_type="CAUSAL_LM"))
    assert _lora_of(lora) == ({"r": 4, "target_modules": ["q_proj", "v_proj"]}, "")
    ia3 = get_peft_model(AutoModelForCausalLM.from_config(config), IA3Config(task_type="CAUSAL_LM"))
    assert _lora_of(ia3)[0] is None and "IA3Config" in _lora_of(ia3)[1]


@pytest.mark.parametrize(
    ("policy", "name"),
    [
        (None, "NO_WRAP"),
        ("transformer_based_wrap", "TRANSFORMER_BASED_WRAP"),
        (transformer_auto_wrap_policy, "TRANSFORMER_BASED_WRAP"),
        (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={torch.nn.Linear}),
            "TRANSFORMER_BASED_WRAP",
        ),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=10), "SIZE_BASED_WRAP"),
    ],
)
def test_the_plugin_wrap_policy_reads_back_as_its_config_name(policy, name):
    assert _wrap_policy_name(policy) == name


def test_checkpointing_is_read_on_the_base_of_a_peft_model():
    from peft import LoraConfig, get_peft_model

    from accel_gradsync.estimator.live import _checkpointing

    model = AutoModelForCausalLM.from_config(load_model_config(dict(RECIPE_DEFAULT_MODEL)))
    assert not _checkpointing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _checkpointing(model)
    assert _checkpointing(get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM")))
