"""The units a launch would have: the model built on the meta device, sharded for an `FSDPSetup` in a
fake process group (fake_shard.py), and read by the adapter a live run reads (`fsdp.adapt_model`).

An `FSDPSetup` becomes accelerate's `FullyShardedDataParallelPlugin` here as `accelerate launch`
builds it from its environment, with the reduce dtype `attach` would write into it. A config
accelerate cannot shard fails as `prepare()` would, in one line naming what to set.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

from accel_gradsync.config.settings import GradSyncConfig
from accel_gradsync.estimator.fake_shard import KeepFrozen, fake_world, shard_like_accelerate, shard_like_transformers
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec
from accel_gradsync.planning.costs import reduce_dtype_policy
from accel_gradsync.planning.residency import splits_frozen
from accel_gradsync.runtime.wrappers.adapt import adapt_model
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


def build_meta_model(config: Any, dtype: torch.dtype = torch.float32, lora: LoraSpec | None = None) -> nn.Module:
    """The model of `config` with every parameter on the meta device: shapes, no storage; with
    `lora`, wrapped by PEFT as a LoRA fine-tune would be (base frozen, adapters trainable)."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # not a causal LM (encoders, vision towers): the bare model
            model = AutoModel.from_config(config, dtype=dtype)
    if lora is None:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError(
            "--lora-r: the LoRA model is built with PEFT; pip install peft, or leave --lora-r out."
        ) from None
    targets = list(lora.target_modules) if lora.target_modules else None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            # PEFT reads transformers 5's deprecated `is_gradient_checkpointing`: not the user's to fix.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            return get_peft_model(model, LoraConfig(r=lora.r, target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as err:  # no default modules for the architecture, or a name it does not have
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"--lora-target-modules: PEFT cannot apply LoRA to {config.model_type}: {first}") from None


class NeedsFreeMemory(Exception):
    """`keep_frozen_unsharded`'s decision reads free memory per rank, and the estimate was given
    none (not a `ValueError`: that would read as accelerate refusing the config)."""


def keep_frozen_for(
    setup: FSDPSetup,
    config: GradSyncConfig,
    mode: str,
    free: int | None,
    taken: int = 0,
    keep_params: bool | None = None,
) -> KeepFrozen | None:
    """What `keep_frozen_unsharded` makes a live prepare do under sync mode `mode` for `setup`
    (`keep_params`, where given, for `keep_params_unsharded`): None where it does nothing (FSDP1, a
    model transformers shards, one process, where attach does nothing, or `splits_frozen` false
    for the mode, as runtime/integration/hooks.py decides); else its settings for the mode, `free`
    (free memory per rank, where given) and `taken` (what resident reference models keep). Which
    units it keeps is decided while sharding, by the runtime's own `FrozenResidency`
    (`estimated_adapter`'s `keep`)."""
    settings = dataclasses.replace(config.resolved(), sync_mode=mode)
    if keep_params is not None:
        settings = dataclasses.replace(settings, keep_params_unsharded=keep_params)
    if setup.fsdp_version != 2 or setup.distributed_config or setup.num_processes == 1 or not splits_frozen(settings):
        return None

    def free_memory() -> int:
        if free is None:
            # The words of the policy's own need (core.py's `_plan_mode`): the row says it once.
            raise NeedsFreeMemory(f"{mode} needs free memory per rank: set --grad-sync-free-memory (e.g. 40GiB).")
        return free

    return KeepFrozen(settings, free_memory, taken)


def estimated_adapter(
    model: nn.Module,
    setup: FSDPSetup,
    config: GradSyncConfig,
    mode: str | None = None,
    torch_release: str | None = None,
    keep: KeepFrozen | None = None,
) -> ModelAdapter:
    """The adapter a launched run reads its units from (`fsdp.adapt_model`, the same code), over
    `model` (meta device) sharded as accelerate would shard it for `setup` and sync mode `mode`
    (default: the config's; it decides the reduce dtype), in a fake process group of
    `setup.num_processes` ranks (fake_shard.py). `model` is wrapped in place. `torch_release`:
    the torch series whose FSDP2 dtype rules the units follow (None: this process's torch).
    `keep` (`keep_frozen_for`): the trainable modules split into units of their own and the
    frozen units kept unsharded (`Unit.resident`) as `keep_frozen_unsharded` does in a live
    prepare; raises `NeedsFreeMemory` where that decision needs free memory and `keep` has none."""
    if setup.distributed_config:
        return _adapt_sharded_by_transformers(model, setup, config, torch_release)
    if setup.hsdp and setup.fsdp_version != 2:
        raise ValueError("parallelism_config dp_replicate_size > 1 needs fsdp_version: 2 in the accelerate config.")
    plugin = build_accelerate_plugin(setup, config, model, mode)
    name, fix = type(model).__name__, _suggest_wrap_fix(model, setup)  # before fully_shard renames the classes
    with fake_world(setup.num_processes):
        try:
            wrapped = shard_like_accelerate(
                model, plugin, setup.mixed_precision, setup.replicate_size, setup.shard_size, keep
            )
        except (ValueError, KeyError, RuntimeError) as err:  # what `accelerate launch` would fail with, at prepare()
            first = str(err).strip().splitlines()[0]  # torch appends the whole module's repr
            raise ValueError(
                f"accelerate cannot shard {name} with this config (FSDP{setup.fsdp_version}, "
                f"fsdp_auto_wrap_policy={setup.auto_wrap_policy}, {setup.replicate_size} replicas x "
                f"{setup.shard_size} shards), so a launch would fail in prepare() too: {first} {fix}"
            ) from None
        adapter = adapt_model(wrapped, torch_release)
        assert adapter is not None  # wrapped by FSDP just above
        return adapter


def build_accelerate_plugin(setup: FSDPSetup, config: GradSyncConfig, model: nn.Module, mode: str | None = None) -> Any:
    """accelerate's `FullyShardedDataParallelPlugin` as a launch with `setup` builds it: its wrap
    policy resolved on `model`, the mixed precision set as `AcceleratorState` sets it, and the
    reduce dtype of sync mode `mode` (default: the config's) written into it as `attach` does
    before `prepare` (`planning.reduce_dtype.reduce_dtype_for`: fp32 for auto and budget when `auto`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp1 = setup.fsdp_version == 1
    # A launch hands FSDP1's strategy over in FSDP_SHARDING_STRATEGY, without the deprecation
    # notice accelerate logs when `sharding_strategy` is passed directly.
    log = logging.getLogger("accelerate.utils.dataclasses")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=setup.fsdp_version,
            auto_wrap_policy=setup.auto_wrap_policy.lower(),
            transformer_cls_names_to_wrap=list(setup.layer_cls_to_wrap) if setup.layer_cls_to_wrap else None,
            min_num_params=setup.min_num_params,
            sharding_strategy=("FULL_SHARD" if setup.reshard_after_forward else "SHARD_GRAD_OP") if fsdp1 else None,
            reshard_after_forward=None if fsdp1 else setup.reshard_after_forward,
            use_orig_params=setup.use_orig_params if fsdp1 else None,
            # Settings the estimate does not read from the config: fixed, not taken from FSDP_* variables.
            cpu_offload=False,
            activation_checkpointing=False,
            sync_module_states=False if fsdp1 else None,
            forward_prefetch=False if fsdp1 else None,
        )
    finally:
        log.setLevel(level)
    plugin.cpu_ram_efficient_loading = False  # set after: passing it would write os.environ
    try:
        plugin.set_auto_wrap_policy(model)
    except ValueError as err:
        names = ",".join(plugin.transformer_cls_names_to_wrap or ())
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap={names}: {err} Use the class name of the transformer layer of "
            f"{type(model).__name__}."
        ) from None
    if setup.mixed_precision != "no":
        plugin.set_mixed_precision(setup.mixed_precision)
    policy = reduce_dtype_policy(plugin, config.resolved().reduce_dtype, mode or config.mode)  # as attach writes it
    if policy is not None:
        plugin.mixed_precision_policy = policy
    return plugin


def find_layer_classes(model: nn.Module) -> list[str]:
    """The class names of `model`'s repeated layers, the usual FSDP units: those of its
    `_no_split_modules` that occur more than once, else the class in its longest `ModuleList`."""
    counts = Counter(type(m).__name__ for m in model.modules())
    named = sorted(c for c in getattr(model, "_no_split_modules", None) or () if counts[c] > 1)
    if named:
        return named
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return [type(max(lists, key=len)[0]).__name__] if lists else []


def _adapt_sharded_by_transformers(
    model: nn.Module, setup: FSDPSetup, config: GradSyncConfig, torch_release: str | None = None
) -> ModelAdapter:
    """`estimated_adapter` for a model transformers shards at load time: no plugin, so no reduce
    dtype of the estimate's reaches it."""
    if config.resolved().reduce_dtype != "auto":
        raise ValueError(
            f"reduce_dtype={config.reduce_dtype!r} cannot reach a model transformers shards at load time; "
            "DistributedConfig(fsdp_mixed_precision=True) gives bf16 params with an fp32 reduce, else the "
            "params' dtype is reduced."
        )
    with fake_world(setup.num_processes):
        adapter = adapt_model(shard_like_transformers(model, dict(setup.distributed_config)), torch_release)
        assert adapter is not None  # fully_shard wraps the root
        return adapter


def _suggest_wrap_fix(model: nn.Module, setup: FSDPSetup) -> str:
    """What to change in the accelerate config when accelerate cannot shard `model` with `setup`."""
    trainable = {p.requires_grad for p in model.parameters()}
    if setup.fsdp_version == 1 and not setup.use_orig_params and len(trainable) == 2:
        # FSDP1 flattens a unit's params into one tensor, all trainable or all frozen; LoRA mixes them.
        return (
            "Set fsdp_use_orig_params: true in the accelerate config's fsdp_config: FSDP1 needs it for a "
            "model with trainable and frozen parameters in one unit (a LoRA fine-tune), or use fsdp_version: 2."
        )
    if setup.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" or setup.layer_cls_to_wrap is not None:
        return "Change the wrap policy or the parallelism_config."
    default = ",".join(sorted(getattr(model, "_no_split_modules", None) or ())) or "none"
    layers = ",".join(find_layer_classes(model)) or "<the class of its transformer layer>"
    return (
        f"Set fsdp_transformer_layer_cls_to_wrap: {layers} in the accelerate config's fsdp_config (without it "
        f"accelerate wraps the model's _no_split_modules: {default})."
    )
