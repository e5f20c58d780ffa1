"""`attach()`: put a sync policy behind an Accelerator's `accumulate()` / `no_sync()`, or a Trainer's.
(A module of another name, as torch's `fully_shard` lives in `_fully_shard.py`, so that the
package's `attach` stays the function.)

Everything that can be refused is refused here, before any training step: a target that is
neither, fewer than one micro-batch per optimizer step, a second attach, an accelerate config
that would train unsharded or sync every micro-batch anyway, a `reduce_dtype` or
`keep_frozen_unsharded=true` that comes after the model was wrapped (auto says it keeps nothing
there). `reduce_dtype` (fp32 for `auto` and `budget` under bf16 mixed precision) is written into
the FSDP plugin's public `mixed_precision_policy` field before `prepare`. This is the one place
a handle is assembled: `GradSyncHandle(...)` (runtime/handle.py) builds the runtime's owners,
then, after the checks, `connect` binds the models prepared before and hooks the accelerator and
the Trainer.

Shims for other libraries that attach relies on (accel_gradsync/compat/): `cpu` (real FSDP over
gloo without a GPU: `enable_cpu_fsdp`), `teardown` (gloo's exit-time abort), `optimizer_state`
(FSDP1's sharded optimizer reloaded whole on resume), `versions` (the tested torch release).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from accel_gradsync.compat.cpu import fsdp_requested
from accel_gradsync.compat.teardown import install_exit_guard
from accel_gradsync.compat.versions import warn_if_untested_torch
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import GradSyncConfig, ResolvedConfig, SyncMode, dtype_name
from accel_gradsync.estimator.forecast.live import LiveForecaster
from accel_gradsync.planning.costs import reduce_dtype_policy
from accel_gradsync.planning.memory import MemoryProbe
from accel_gradsync.planning.policies import SyncPolicy
from accel_gradsync.planning.residency import frozen_residency_under_vllm, splits_frozen
from accel_gradsync.runtime.handle import GradSyncHandle
from accel_gradsync.runtime.integration.hooks import is_hooked
from accel_gradsync.runtime.wrappers.adapt import model_name
from accel_gradsync.runtime.wrappers.frozen_units import applies


def attach(
    target: Any, config: GradSyncConfig | None = None, *, memory_probe: MemoryProbe | None = None
) -> GradSyncHandle:
    """Make `target`'s `accumulate()` / `no_sync()` follow `config`.

    Every micro-batch that does not end an optimizer step then holds, per FSDP unit, what the
    sync mode plans (`requires_gradient_sync` / `requires_all_reduce` off, parameters kept
    unsharded in a window); the one that ends it syncs every unit. Models are bound when
    accelerate prepares them (or at the Trainer's train start, or their first `no_sync`), and
    the main process prints one decision line per model.

    Args:
        target (`accelerate.Accelerator` or `transformers.Trainer`):
            An Accelerator, before or after `prepare` (before, with a `reduce_dtype` other than
            `auto`), or a Trainer (any TRL trainer) before `train()`, including one whose model
            transformers sharded at load time (`DistributedConfig`).
        config (`GradSyncConfig`, *optional*):
            The sync settings; defaults to `GradSyncConfig()` (environment, then defaults).
        memory_probe (`accel_gradsync.planning.memory.MemoryProbe`, *optional*):
            Replaces the device memory readings `auto` plans from (tests, dry runs:
            `accel_gradsync.planning.memory.ScriptedMemoryProbe`).

    Returns:
        `GradSyncHandle`: `stats()`, `plan()`, `units()`, `describe()` and `detach()`; also a
        context manager that detaches on exit.

    Raises:
        `TypeError`: `target` is neither an Accelerator nor a Trainer, or `config` is not a
            `GradSyncConfig`.
        `ValueError`: before any training step, for what would not run as asked: a second
            attach, an FSDP config that trains unsharded, `sync_each_batch=True` with a holding
            mode, a `reduce_dtype` or `keep_frozen_unsharded=true` after `prepare`, a mode the
            wrapper cannot run (at bind).
    """
    config = GradSyncConfig() if config is None else config
    if not isinstance(config, GradSyncConfig):
        raise TypeError(f"attach(config=...) takes a GradSyncConfig, got {type(config).__name__}.")
    warn_if_untested_torch()  # fsdp2_state.check_fsdp2_internals raises at bind if an attribute it reads is gone
    accelerator, trainer = _resolve_target(target)
    _check_micro_batches(accelerator, trainer)
    if is_hooked(accelerator):
        raise ValueError(
            "accel_gradsync.attach() was already called on this accelerator; call `.detach()` on the "
            "handle it returned before attaching again."
        )
    settings = _check_frozen_residency(accelerator, config.resolved(), trainer)  # once: only these go below
    forecaster = LiveForecaster(accelerator, settings)  # auto's step-1 plan, when a shape is set
    handle = GradSyncHandle(accelerator, settings, trainer, memory_probe, forecaster)  # builds, hooks nothing
    _check_accelerate_config(accelerator, handle.policy)
    install_exit_guard()  # gloo's workers must be done before the interpreter exits (teardown.py)
    reason = _reason_not_applicable(accelerator)
    if reason is not None:
        warnings.warn(f"accel_gradsync: {reason}; attach() does nothing.", GradSyncWarning, stacklevel=2)
        handle.connect(None)  # save_on_signal only: a Trainer's, also on one process
        return handle
    models = list(getattr(accelerator, "_models", [])) if trainer is None else []
    _check_prepared_before(accelerator, settings, models)
    _apply_reduce_dtype(accelerator, settings, handle.policy.name, already_prepared=bool(models))
    handle.connect(models)
    return handle


def _resolve_target(target: Any) -> tuple[Accelerator, Any]:
    if isinstance(target, Accelerator):
        return target, None
    accelerator = getattr(target, "accelerator", None)
    if isinstance(accelerator, Accelerator) and hasattr(target, "add_callback"):
        return accelerator, target  # a transformers.Trainer or any subclass (TRL trainers)
    raise TypeError(
        f"accel_gradsync.attach() takes an accelerate.Accelerator or a transformers.Trainer, got "
        f"{type(target).__module__}.{type(target).__name__}."
    )


def _check_micro_batches(accelerator: Accelerator, trainer: Any) -> None:
    """The window is gradient_accumulation_steps micro-batches: fewer than one is no schedule."""
    if trainer is not None:
        steps, setting = trainer.args.gradient_accumulation_steps, "TrainingArguments.gradient_accumulation_steps"
    else:
        steps, setting = accelerator.gradient_accumulation_steps, "Accelerator(gradient_accumulation_steps=...)"
    if steps < 1:
        raise ValueError(f"{setting}={steps}: must be >= 1, the micro-batches per optimizer step (1: no accumulation).")


def _reason_not_applicable(accelerator: Accelerator) -> str | None:
    if accelerator.num_processes < 2:
        return "single process, so there is no gradient sync to schedule"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        stage = getattr(accelerator.state.deepspeed_plugin, "zero_stage", "?")
        return (
            f"DeepSpeed (ZeRO stage {stage}) reduces gradients itself (ZeRO>=2 after every "
            "micro-batch), so the sync mode cannot be chosen"
        )
    return None


def _check_frozen_residency(accelerator: Accelerator, settings: ResolvedConfig, trainer: Any) -> ResolvedConfig:
    """`keep_frozen_unsharded` where it cannot work. FSDP1: a unit's flat parameter gathers its
    frozen and trained parameters together, so true is refused. A TRL trainer with `use_vllm`:
    `frozen_residency_under_vllm` (true refused, auto keeps nothing: said in one line here)."""
    fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not applies(accelerator)
    if settings.keep_frozen_unsharded is True and fsdp1:
        raise ValueError(
            "keep_frozen_unsharded=true needs FSDP2 (fsdp_version: 2): FSDP1 gathers each unit's frozen and "
            "trained parameters as one flat parameter, so the frozen ones cannot stay gathered alone; set "
            "fsdp_version: 2 in the accelerate config, or keep_frozen_unsharded=false."
        )
    if trainer is None or not getattr(trainer.args, "use_vllm", False) or not applies(accelerator):
        return settings
    under_vllm = frozen_residency_under_vllm(settings)
    params = list(trainer.model.parameters())
    if splits_frozen(settings) and any(p.requires_grad for p in params) and not all(p.requires_grad for p in params):
        accelerator.print(
            "grad sync: keep_frozen_unsharded auto keeps no frozen unit under use_vllm: TRL's weight sync merges "
            "the adapter into the sharded base between steps."
        )
    return under_vllm


def _check_prepared_before(accelerator: Accelerator, settings: ResolvedConfig, models: list) -> None:
    """`keep_frozen_unsharded` on a trained model accelerate sharded before attach: its adapters
    cannot get FSDP2 units of their own any more (frozen_units.py), so true is refused, and auto,
    which would split one with frozen parameters, says in one line that it keeps nothing."""
    if not applies(accelerator) or not splits_frozen(settings):
        return
    for model in models:
        trained = [p.requires_grad for p in model.parameters()]
        if not any(trained):
            continue  # a frozen model: a reference model's residency is keep_reference_unsharded's
        if settings.keep_frozen_unsharded is True:
            raise ValueError(
                f"keep_frozen_unsharded=true, but {model_name(model)} was prepared before "
                "accel_gradsync.attach(): its adapters get FSDP2 units of their own when accelerate shards it; "
                "call attach() before accelerator.prepare(model) (a Trainer prepares in train())."
            )
        if not all(trained):
            accelerator.print(
                f"grad sync: keep_frozen_unsharded auto keeps no frozen unit of {model_name(model)}: it was prepared "
                "before attach(), so its adapters share units with the base; call attach() before "
                "accelerator.prepare(model) to keep the base unsharded."
            )


def _check_accelerate_config(accelerator: Accelerator, policy: SyncPolicy) -> None:
    launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if fsdp_requested() and launched_processes > 1 and accelerator.distributed_type != DistributedType.FSDP:
        raise ValueError(
            f"The accelerate config asks for FSDP (ACCELERATE_USE_FSDP=true) on {launched_processes} "
            f"processes but accelerate runs distributed_type={accelerator.distributed_type} with "
            f"{accelerator.num_processes} process(es), so the model would train unsharded. On a "
            "machine without GPU/NPU call accel_gradsync.enable_cpu_fsdp() before building the "
            "Accelerator/Trainer, and give the Trainer "
            "`accelerator_config={'use_configured_state': True}`."
        )
    sync_each_batch = accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
    if policy.name != SyncMode.PER_MICRO_BATCH and sync_each_batch:
        raise ValueError(
            f"GradSyncConfig selects sync mode '{policy.name}' but accelerate's "
            "GradientAccumulationPlugin(sync_each_batch=True) syncs every micro-batch. Drop "
            "sync_each_batch (in a Trainer: accelerator_config.gradient_accumulation_kwargs), or "
            "use sync mode 'per_micro_batch' (GradSyncConfig(defer=False))."
        )


def _apply_reduce_dtype(accelerator: Accelerator, settings: ResolvedConfig, mode: str, already_prepared: bool) -> None:
    """Write the reduce dtype of `mode` into the FSDP plugin's policy (`reduce_dtype_policy`). One
    the mode chose itself (fp32 for auto and budget) is said in one line; after prepare it cannot
    be set, and the plan's warning (decision.warn_about_plan) says what bf16 sums cost."""
    chosen = settings.reduce_dtype
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        if chosen != "auto":
            warnings.warn(
                f"accel_gradsync: reduce_dtype={chosen!r} is ignored: it sets the FSDP "
                "mixed-precision policy and this run does not use FSDP.",
                GradSyncWarning,
                stacklevel=3,
            )
        return
    policy = reduce_dtype_policy(plugin, chosen, mode)
    if policy is None:
        return
    if already_prepared:
        if chosen == "auto":
            return
        raise ValueError(
            f"GradSyncConfig.reduce_dtype={chosen!r} must reach FSDP before the model "
            "is wrapped: call accel_gradsync.attach(accelerator, config) before accelerator.prepare(...)."
        )
    plugin.mixed_precision_policy = policy
    if chosen == "auto":
        low = dtype_name(policy.param_dtype)
        if plugin.fsdp_version == 2:
            effect = f"held gradients are summed in fp32 as per-micro-batch sync sums them, not in {low}"
            keep = f"reduce_dtype=bf16 holds half the bytes, summed in {low}"
        else:  # FSDP1's no_sync() holds the compute dtype whatever the reduce dtype
            effect = f"each micro-batch is reduced and summed in fp32; {mode} does not defer (FSDP1 sums in {low})"
            keep = f"reduce_dtype=bf16 lets {mode} defer, summed in {low}"
        accelerator.print(f"grad sync: reduce_dtype set to fp32 for sync mode {mode} ({low} compute): {effect}; {keep}")
