"""`LiveForecaster`: the whole-step forecast `auto` plans step 1 from, for a model being bound.

The forecast is the estimate's (step_peak.py: a step that syncs every micro-batch and holds
nothing, in the run's dtypes and reduce dtype; then the plan `auto` chose from it, simulated as the
estimate's row for that plan). It runs in a fake process group, which cannot share a process with
the run's real one, so the main process runs it in a child (forecast_child.py) from the model's
config and the launch as the Accelerator holds it, and broadcasts each answer: every rank plans
from the same numbers. A LoRA model is built with its adapters, split into units of their own and
its frozen units kept where the run's prepare kept them (`keep_frozen_unsharded`). A model the
forecast cannot build from its config, or a launch it does not run, gets a `Forecast` without a
peak that says why, and `auto` measures step 1 as it does without a forecast.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator

from accel_gradsync.config.settings import DTYPES, ResolvedConfig, dtype_name, spelled
from accel_gradsync.estimator.forecast.forecast_child import ForecastChild
from accel_gradsync.planning.replan import Forecast
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.wrappers.adapt import sharded_by_transformers

_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_", "MASTER_", "PARALLELISM_CONFIG_")


class LiveForecaster:
    """`planning.replan.Forecaster` for the models one `attach()` binds."""

    def __init__(self, accelerator: Accelerator, settings: ResolvedConfig) -> None:
        self.accelerator, self.settings = accelerator, settings

    def forecast(self, model: Any, micro_batches: int, kept: Sequence[str] = ()) -> Forecast:
        """The forecast of `model`'s step over `micro_batches`, the same on every rank; its
        `simulate` forecasts a plan (a collective: every rank calls it with the same plan).
        `kept`: the units `keep_frozen_unsharded` keeps, as prepare kept them."""
        answer: list[Any] = [None]
        child = None
        if self.accelerator.is_main_process:
            start = time.monotonic()
            try:
                answer[0], child = self._forecast_here(model, micro_batches, kept)
            except Exception as error:  # noqa: BLE001 - any failure means: measure step 1 instead
                answer[0] = Forecast(None, f"the forecast failed: {type(error).__name__}: {error}")
            if answer[0].peak_bytes is not None:
                answer[0] = Forecast(answer[0].peak_bytes, f"{answer[0].note}, in {time.monotonic() - start:.0f} s")
        self._broadcast(answer)
        if answer[0].peak_bytes is None:
            return answer[0]
        return dataclasses.replace(answer[0], simulate=functools.partial(self._simulate, child))

    def _forecast_here(
        self, model: Any, micro_batches: int, kept: Sequence[str]
    ) -> tuple[Forecast, ForecastChild | None]:
        spec, why = self._spec(model, micro_batches)
        if spec is None:
            return Forecast(None, f"no forecast: {why}"), None
        spec["kept"] = list(kept)
        child = ForecastChild(spec, _child_environment())
        result = child.forecast_unheld()
        left_out = f"; leaves out {'; '.join(result['unmodeled'])}" if result["unmodeled"] else ""
        return Forecast(int(result["peak_bytes"]), f"{result['shape']}{left_out}"), child

    def _simulate(self, child: ForecastChild | None, plan: Plan) -> Forecast:
        """`plan`'s step peak from the child still running for this model (the main process's),
        broadcast; the child ends with the answer (a plan made again starts another)."""
        answer: list[Any] = [None]
        if child is not None:
            try:
                result = child.forecast_plan(plan)
                answer[0] = Forecast(int(result["peak_bytes"]), f"peak at {result['phase'].replace('_', ' ')}")
            except Exception as error:  # noqa: BLE001 - any failure means: measure step 1 instead
                answer[0] = Forecast(None, f"the plan's forecast failed: {type(error).__name__}: {error}")
            finally:
                child.close()
        self._broadcast(answer)
        return answer[0]

    def _broadcast(self, answer: list[Any]) -> None:
        """The main process's `answer[0]` on every rank."""
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(answer, src=0, device=self.accelerator.device)

    def _spec(self, model: Any, micro_batches: int) -> tuple[dict | None, str]:
        """What the child needs, or None and why the forecast cannot run for this model."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None or plugin.fsdp_version != 2:
            return None, "the step forecast runs FSDP2 (fsdp_version: 2) only"
        if sharded_by_transformers(model):
            return None, "transformers sharded this model at load time; the forecast shards as accelerate does"
        inner = self.accelerator.unwrap_model(model)
        lora, why = _lora_of(inner)
        if why:
            return None, why
        model_config = getattr(inner, "config", None)
        if model_config is None or not hasattr(model_config, "save_pretrained"):
            return None, f"{type(inner).__name__} has no transformers config to build it from"
        optimizer = self._optimizer_name()
        if optimizer is None:
            return None, "the forecast models AdamW and SGD optimizers only"
        parallel = getattr(self.accelerator, "parallelism_config", None)
        replicate = getattr(parallel, "dp_replicate_size", 1) if parallel is not None else 1
        if replicate > 1:
            return None, "the step forecast does not run HSDP meshes yet"
        dtype = next(inner.parameters()).dtype
        if dtype not in DTYPES.values():
            return None, f"weights in {dtype}; the forecast builds fp32, bf16 or fp16 models"
        settings = spelled(self.settings)  # as GradSyncConfig takes them back, in the child
        shape = {
            "micro_batch_size": self.settings.forecast_micro_batch_size,
            "seq_len": self.settings.forecast_seq_len,
            "optimizer": optimizer,
            "gradient_checkpointing": _checkpointing(inner),
        }
        spec = {
            "model_config": model_config,
            "model_dtype": dtype_name(dtype),
            "accelerate_config": {
                "distributed_type": "FSDP",
                "num_processes": self.accelerator.num_processes,
                "mixed_precision": str(self.accelerator.mixed_precision),
                "fsdp_config": {
                    "fsdp_version": 2,
                    "fsdp_auto_wrap_policy": _wrap_policy_name(plugin.auto_wrap_policy),
                    "fsdp_transformer_layer_cls_to_wrap": plugin.transformer_cls_names_to_wrap,
                    "fsdp_min_num_params": plugin.min_num_params or 0,
                    "fsdp_reshard_after_forward": str(plugin.reshard_after_forward).lower(),
                },
            },
            "lora": lora,
            "settings": settings,
            "shape": shape,
            "micro_batches": micro_batches,
        }
        return spec, ""

    def _optimizer_name(self) -> str | None:
        """`adamw` or `sgd` for the optimizer accelerate prepared (AdamW, the Trainer's default,
        before one is prepared); None for another."""
        optimizers = [getattr(o, "optimizer", o) for o in getattr(self.accelerator, "_optimizers", [])]
        if not optimizers:
            return "adamw"
        if isinstance(optimizers[0], (torch.optim.AdamW, torch.optim.Adam)):
            return "adamw"
        return "sgd" if isinstance(optimizers[0], torch.optim.SGD) else None


def _lora_of(model: Any) -> tuple[dict | None, str]:
    """A PEFT model's LoRA rank and modules (None: not a PEFT model), or why it cannot be forecast."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None, ""
    if len(configs) != 1:
        return None, f"a PEFT model with {len(configs)} adapters; the forecast builds one LoRA adapter"
    (peft_config,) = configs.values()
    if type(peft_config).__name__ != "LoraConfig":
        return None, f"a PEFT {type(peft_config).__name__} model; the forecast builds LoRA adapters only"
    targets = peft_config.target_modules
    if isinstance(targets, str):  # PEFT's regular-expression form: not a list of module names
        return None, f"LoRA target_modules given as the pattern {targets!r}; the forecast takes module names"
    return {"r": int(peft_config.r), "target_modules": sorted(targets) if targets else None}, ""


def _checkpointing(model: Any) -> bool:
    """Whether activation checkpointing is on (transformers 5's name, then the older one), read on
    the transformers model (under PEFT, its base model)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in getattr(model, "__dict__", {}):
            return bool(getattr(model, name))
    return False


def _wrap_policy_name(policy: Any) -> str:
    """The accelerate config name of the plugin's wrap policy (a function once accelerate read it)."""
    if policy is None:
        return "NO_WRAP"
    if isinstance(policy, str):
        return policy.upper()
    function = policy.func if isinstance(policy, functools.partial) else policy
    return "SIZE_BASED_WRAP" if "size_based" in getattr(function, "__name__", "") else "TRANSFORMER_BASED_WRAP"


def _child_environment() -> dict[str, str]:
    """This process's environment without the launch's: the child is one process in a fake group,
    and it touches no accelerator device."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(CUDA_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="")
    return env
