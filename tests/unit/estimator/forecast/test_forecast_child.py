"""The step forecast's child (estimator/forecast/forecast_child.py), computed here in-process from a spec as
the child gets it: its first answer is the estimate's per_micro_batch row, a plan it is sent is
the estimate's row for that plan. The child process itself (pipes, signals held) runs in
tests/distributed/test_forecast_auto.py."""

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.forecast.forecast_child import ForecastSession, forecast_unheld_step
from accel_gradsync.estimator.inputs import LoraSpec, StepShape

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


@pytest.mark.slow  # a second forecast; the LoRA forecast itself is in test_step_peak.py
def test_the_child_forecasts_a_lora_model_with_its_adapters():
    answer = forecast_unheld_step(_spec())
    lora = forecast_unheld_step(_spec({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    assert lora["peak_bytes"] < answer["peak_bytes"] and "LoRA r=8" in lora["shape"]
    lora_est = estimate(
        "recipe-default", LAUNCH, 4, step_shape=StepShape(2, 32), lora=LoraSpec(8, ("q_proj", "v_proj"))
    )
    assert lora["peak_bytes"] == lora_est.mode("per_micro_batch").step_peak_bytes


def test_the_child_answers_the_estimates_rows_first_per_micro_batch_then_the_plan_it_is_sent():
    session = ForecastSession(_spec())
    est = estimate("recipe-default", LAUNCH, 4, GradSyncConfig(sync_mode="auto"), step_shape=StepShape(2, 32))
    answer = session.forecast_unheld()
    assert answer["peak_bytes"] == est.mode("per_micro_batch").step_peak_bytes
    assert answer["unmodeled"] == [] and answer["shape"].startswith("2x32 tokens per micro-batch, adamw")
    names = [u.name for u in session.adapter.units]
    every_unit_windowed = {"held": names, "windowed": names, "held_sync": "gradient_sync", "generation_bytes": 0}
    assert session.forecast_plan(every_unit_windowed)["peak_bytes"] == est.mode("deferred+windowed").step_peak_bytes
    with pytest.raises(ValueError, match="'model.nowhere' is not among the forecast model's units"):
        session.forecast_plan({**every_unit_windowed, "held": ["model.nowhere"]})
