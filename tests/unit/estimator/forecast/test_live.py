"""`LiveForecaster`'s parts that need no run (estimator/forecast/live.py): what it reads of a live model and
plugin (the child's forecast: test_forecast_child.py; the whole path, child process and broadcast,
runs in tests/distributed/test_forecast_auto.py)."""

import functools

import pytest
import torch
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM

from accel_gradsync.estimator.forecast.live import _lora_of, _wrap_policy_name
from accel_gradsync.estimator.inputs import RECIPE_DEFAULT_MODEL, load_model_config


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

    from accel_gradsync.estimator.forecast.live import _checkpointing

    model = AutoModelForCausalLM.from_config(load_model_config(dict(RECIPE_DEFAULT_MODEL)))
    assert not _checkpointing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _checkpointing(model)
    assert _checkpointing(get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM")))
