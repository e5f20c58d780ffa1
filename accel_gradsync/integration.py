"""`attach()`: put a sync policy behind an Accelerator's `accumulate()` / `no_sync()`, or a Trainer's.

accelerate has no hook registry around these, and its classes must not be patched. So `attach`
gives the one accelerator instance a subclass of its own class that overrides `no_sync` (the
per-instance subclassing torch's `fully_shard` and `parametrize` use on modules); `detach`
gives the original class back. Both `Accelerator.accumulate()` and the Trainer's inner loop
enter `self.no_sync(model)` on every micro-batch that is not the last, so both reach the policy.
Where accelerate already does the right thing it is reused through `super().no_sync`: the
root `no_sync()` of FSDP1 and DDP. Its FSDP2 branch is replaced, because it sets
`requires_gradient_sync(True)` on every unit on exit instead of restoring their previous state.

A forward pre-hook on the prepared model (inside DDP's wrapper) counts the micro-batches that
run with gradients.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .accounting import SyncAccounting
from .config import GradSyncConfig
from .cpu import fsdp_requested
from .errors import GradSyncWarning
from .fsdp import ModelAdapter, Unit, adapt_model, is_fsdp_wrapped
from .policies import SyncPolicy, resolve_policy

_HANDLE_ATTR = "_accel_gradsync_handle"  # class attribute of the per-instance subclass


def attach(target: Any, config: Optional[GradSyncConfig] = None) -> "GradSyncHandle":
    """Make `target`'s `accumulate()` / `no_sync()` follow `config` (default: `GradSyncConfig()`).

    `target` is an `accelerate.Accelerator` whose model is already prepared, or a
    `transformers.Trainer` (any TRL trainer), before `train()`. Returns a handle with
    `stats()` and `detach()`; it is also a context manager that detaches on exit.
    """
    config = GradSyncConfig() if config is None else config
    if not isinstance(config, GradSyncConfig):
        raise TypeError(f"attach(config=...) takes a GradSyncConfig, got {type(config).__name__}.")
    accelerator, trainer = _resolve_target(target)
    if getattr(type(accelerator), _HANDLE_ATTR, None) is not None:
        raise ValueError(
            "accel_gradsync.attach() was already called on this accelerator; call `.detach()` on the "
            "handle it returned before attaching again."
        )
    return GradSyncHandle(accelerator, config, trainer)


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


class GradSyncHandle:
    """What `attach` returns: live counters (`stats()`) and `detach()`."""

    def __init__(self, accelerator: Accelerator, config: GradSyncConfig, trainer: Any = None) -> None:
        self.accelerator = accelerator
        self.config = config
        self.policy: SyncPolicy = resolve_policy(config)
        self.accounting = SyncAccounting(mode=self.policy.name)
        self._trainer = trainer
        self._adapters: dict[int, Optional[ModelAdapter]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._held: Optional[list[Unit]] = None
        self._callback = None
        self._original_class: Optional[type] = None

        self._check_accelerate_config()
        reason = self._reason_not_applicable()
        if reason is not None:
            warnings.warn(f"accel_gradsync: {reason}; attach() does nothing.", GradSyncWarning, stacklevel=3)
            return
        if trainer is not None:
            from .trainer import GradSyncCallback

            self._callback = GradSyncCallback(self)
            # First in line, so the reporting callbacks (TensorBoard, W&B, ...) see our keys.
            trainer.callback_handler.callbacks.insert(0, self._callback)
        else:
            models = list(getattr(accelerator, "_models", []))
            if not models:
                raise ValueError(
                    "accel_gradsync.attach(accelerator) found no prepared model: call it after "
                    "`accelerator.prepare(model, ...)`."
                )
            try:
                for model in models:
                    # accelerate lists DDP models unwrapped; those bind at their first no_sync().
                    if accelerator.distributed_type == DistributedType.FSDP or adapt_model(model) is not None:
                        self.bind(model)
            except Exception:
                self.detach()
                raise
        self._hook_accelerator()

    # -- public ---------------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        """M: micro-batches per optimizer step (the Trainer keeps it outside accelerate)."""
        if self._trainer is not None:
            return int(self._trainer.args.gradient_accumulation_steps)
        return int(self.accelerator.gradient_accumulation_steps)

    def stats(self) -> dict:
        """Counters since attach: micro-batches (all and deferred), optimizer steps, unit
        reduce-scatters (all-reduces for DDP) issued and skipped; `last_step/*` for the last
        finished optimizer step."""
        return self.accounting.stats()

    def describe(self, adapter: Optional[ModelAdapter] = None) -> str:
        """The decision line printed at start, e.g. `grad sync: deferred over 4 micro-batches ...`."""
        adapter = adapter or next((a for a in self._adapters.values() if a is not None), None)
        if adapter is None:
            return f"grad sync: {self.policy.name} (no FSDP/DDP model bound yet)"
        return describe_decision(self.policy, adapter, self.micro_batches_per_step)

    def detach(self) -> None:
        """Undo `attach`: the accelerator's own `no_sync` again, hooks and callback removed."""
        if self._original_class is not None:
            self.accelerator.__class__ = self._original_class
            self._original_class = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._callback is not None:
            self._trainer.remove_callback(self._callback)
            self._callback = None

    def __enter__(self) -> "GradSyncHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- set-up -----------------------------------------------------------------------------
    def _reason_not_applicable(self) -> Optional[str]:
        acc = self.accelerator
        if acc.num_processes < 2:
            return "single process, so there is no gradient sync to schedule"
        if acc.distributed_type == DistributedType.DEEPSPEED:
            stage = getattr(acc.state.deepspeed_plugin, "zero_stage", "?")
            return (
                f"DeepSpeed (ZeRO stage {stage}) reduces gradients itself (ZeRO>=2 after every "
                "micro-batch), so the sync mode cannot be chosen"
            )
        return None

    def _check_accelerate_config(self) -> None:
        acc = self.accelerator
        launched_processes = int(os.environ.get("WORLD_SIZE", "1"))
        if fsdp_requested() and launched_processes > 1 and acc.distributed_type != DistributedType.FSDP:
            raise ValueError(
                f"The accelerate config asks for FSDP (ACCELERATE_USE_FSDP=true) on {launched_processes} "
                f"processes but accelerate runs distributed_type={acc.distributed_type} with "
                f"{acc.num_processes} process(es), so the model would train unsharded. On a "
                "machine without GPU/NPU call accel_gradsync.enable_cpu_fsdp() before building the "
                "Accelerator/Trainer, and give the Trainer "
                "`accelerator_config={'use_configured_state': True}`."
            )
        sync_each_batch = acc.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        if self.policy.name != "per_micro_batch" and sync_each_batch:
            raise ValueError(
                f"GradSyncConfig selects sync mode {self.policy.name!r} but accelerate's "
                "GradientAccumulationPlugin(sync_each_batch=True) syncs every micro-batch. Drop "
                "sync_each_batch (in a Trainer: accelerator_config.gradient_accumulation_kwargs), or "
                "set GradSyncConfig(defer=False)."
            )

    def _hook_accelerator(self) -> None:
        handle = self
        base = type(self.accelerator)

        class GradSyncAccelerator(base):  # type: ignore[misc, valid-type]
            @contextlib.contextmanager
            def no_sync(self, model):  # noqa: D401 - accelerate's signature
                with handle._no_sync(model, super().no_sync):
                    yield

        GradSyncAccelerator.__name__ = GradSyncAccelerator.__qualname__ = f"GradSync{base.__name__}"
        setattr(GradSyncAccelerator, _HANDLE_ATTR, self)
        self._original_class = base
        self.accelerator.__class__ = GradSyncAccelerator

    def bind(self, model: nn.Module) -> Optional[ModelAdapter]:
        """Inspect a prepared model once: its wrapper and units, and the micro-batch counter."""
        root = model.module if isinstance(model, DistributedDataParallel) else model
        if id(root) in self._adapters:
            return self._adapters[id(root)]
        adapter = adapt_model(model)
        expects_fsdp = self.accelerator.distributed_type == DistributedType.FSDP
        if expects_fsdp and (adapter is None or adapter.kind == "ddp"):
            raise ValueError(
                f"The accelerate config asks for FSDP but the prepared model ({type(model).__name__}) is "
                f"{'only partly FSDP-wrapped' if is_fsdp_wrapped(model) else 'not FSDP-wrapped'}: it "
                "would train unsharded. Pass the model through `accelerator.prepare` (the Trainer does), "
                "and check the fsdp auto-wrap policy in the accelerate config."
            )
        if adapter is None:
            warnings.warn(
                f"accel_gradsync: the prepared model ({type(model).__name__}) is not wrapped in FSDP or "
                "DDP, so it has no gradient sync to schedule; accelerate's own no_sync() applies.",
                GradSyncWarning,
                stacklevel=2,
            )
        else:
            self._hooks.append(root.register_forward_pre_hook(self._on_forward))
            acc = self.accounting
            acc.wrapper, acc.collective, acc.units = adapter.kind, adapter.collective, len(adapter.units)
            # One line at start, on the main process only: the decision and what it costs.
            self.accelerator.print(self.describe(adapter))
        self._adapters[id(root)] = adapter
        return adapter

    # -- hot path -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _no_sync(self, model: nn.Module, accelerate_no_sync) -> Iterator[None]:
        adapter = self.bind(model)
        if adapter is None:
            with accelerate_no_sync(model):
                yield
            return
        # The micro-batch that ends an optimizer step always syncs, whatever asked for no_sync.
        held = [] if self.accelerator.sync_gradients else self.policy.deferred_units(adapter.units)
        if not held:
            yield
            return
        if adapter.root_only:
            assert len(held) == len(adapter.units), f"{adapter.kind} can only defer every unit at once"
            context = accelerate_no_sync(model)
        else:
            context = adapter.hold(held)
        self._held = held
        try:
            with context:
                yield
        finally:
            self._held = None

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # generation, evaluation, or log-prob passes without gradients
        adapter = self._adapters[id(module)]
        held = self._held or []
        synced = adapter.units if not held else [u for u in adapter.units if u not in held]
        self.accounting.record_micro_batch(synced, held, ends_step=self.accelerator.sync_gradients)


def describe_decision(policy: SyncPolicy, adapter: ModelAdapter, micro_batches: int) -> str:
    """One line: the mode, and the collectives per optimizer step it implies."""
    per_sync = sum(u.collectives for u in adapter.units)
    name = adapter.collective.replace("_", "-") + "s"
    held = len(policy.deferred_units(adapter.units))
    chosen = per_sync * micro_batches - sum(u.collectives for u in policy.deferred_units(adapter.units)) * (
        micro_batches - 1
    )
    return (
        f"grad sync: {policy.name} over {micro_batches} micro-batches on {adapter.kind} "
        f"({len(adapter.units)} units, {held} deferred) -> {chosen} unit {name}/step "
        f"instead of {per_sync * micro_batches}"
    )
