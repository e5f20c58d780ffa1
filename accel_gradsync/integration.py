"""`attach()`: put a sync policy behind an Accelerator's `accumulate()` / `no_sync()`, or a Trainer's.

accelerate has no hook registry around these, and its classes must not be patched. So `attach`
gives the one accelerator instance a subclass of its own class that overrides `no_sync` and
`prepare` (the per-instance subclassing torch's `fully_shard` and `parametrize` use on
modules); `detach` gives the original class back. Both `Accelerator.accumulate()` and the
Trainer's inner loop enter `self.no_sync(model)` on every micro-batch that is not the last,
so both reach the policy. Where accelerate already does the right thing it is reused through
`super()`: the root `no_sync()` of FSDP1 and DDP, and all of `prepare`. Its FSDP2 branch is
replaced, because it sets `requires_gradient_sync(True)` on every unit on exit instead of
restoring their previous state, and cannot hold only some units.

A forward pre-hook on the prepared model (inside DDP's wrapper) counts the micro-batches that
run with gradients. `reduce_dtype` is written into the FSDP plugin's `mixed_precision_policy`
field (the public dataclass field accelerate builds `fully_shard` from) before prepare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .accounting import SyncAccounting, combined_stats
from .config import GradSyncConfig
from .cpu import fsdp_requested
from .errors import GradSyncWarning
from .fsdp import ModelAdapter, adapt_model, is_fsdp_wrapped
from .memory import MemoryProbe, agreed_free_memory, memory_probe
from .policies import (
    ALL_REDUCE,
    Plan,
    SyncPolicy,
    all_gathers_per_step,
    collectives_per_step,
    format_bytes,
    resolve_policy,
)
from .replan import MeasuredAuto
from .teardown import install_exit_guard
from .versions import warn_if_untested_torch

_HANDLE_ATTR = "_accel_gradsync_handle"  # class attribute of the per-instance subclass
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def attach(
    target: Any, config: Optional[GradSyncConfig] = None, *, memory_probe: Optional[MemoryProbe] = None
) -> "GradSyncHandle":
    """Make `target`'s `accumulate()` / `no_sync()` follow `config` (default: `GradSyncConfig()`).

    `target` is an `accelerate.Accelerator` (before or after `prepare`; with a `reduce_dtype`
    other than auto, before) or a `transformers.Trainer` (any TRL trainer) before `train()`.
    Returns a handle with `stats()` and `detach()`; it is also a context manager.
    `memory_probe` replaces the device's memory readings that `auto` plans from (tests, dry
    runs: `accel_gradsync.memory.ScriptedMemoryProbe`).
    """
    config = GradSyncConfig() if config is None else config
    if not isinstance(config, GradSyncConfig):
        raise TypeError(f"attach(config=...) takes a GradSyncConfig, got {type(config).__name__}.")
    warn_if_untested_torch()  # fsdp.check_fsdp2_internals raises at bind if an attribute it reads is gone
    accelerator, trainer = _resolve_target(target)
    if getattr(type(accelerator), _HANDLE_ATTR, None) is not None:
        raise ValueError(
            "accel_gradsync.attach() was already called on this accelerator; call `.detach()` on the "
            "handle it returned before attaching again."
        )
    return GradSyncHandle(accelerator, config, trainer, memory_probe)


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
    """What `attach` returns: live counters (`stats()`), the plan, and `detach()`."""

    def __init__(
        self, accelerator: Accelerator, config: GradSyncConfig, trainer: Any = None,
        memory_probe: Optional[MemoryProbe] = None,
    ) -> None:  # fmt: skip
        self.accelerator = accelerator
        self.config = config
        self.policy: SyncPolicy = resolve_policy(config)
        self._accounts: dict[int, SyncAccounting] = {}  # per bound model, by id(root)
        self._names: dict[int, str] = {}
        self._trainer = trainer
        self._adapters: dict[int, Optional[ModelAdapter]] = {}
        self._plans: dict[int, Plan] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._held: dict[int, tuple[list, str]] = {}  # by id(root): (units held, how) during a held micro-batch
        self._warned: set[str] = set()
        self._callback = None
        self._original_class: Optional[type] = None
        self._free_memory: Optional[int] = None
        self._memory_probe = memory_probe
        self._auto: dict[int, list] = {}  # measured auto per model: [MeasuredAuto, window key at the last read]
        self._pending_grads: Optional[list] = None  # from a mid-window checkpoint, until the next micro-batch
        self._restore_forward: Optional[Any] = None  # flags to put back after the last micro-batch's forward

        self._check_accelerate_config()
        install_exit_guard()  # gloo's workers must be done before the interpreter exits (teardown.py)
        reason = self._reason_not_applicable()
        if reason is not None:
            warnings.warn(f"accel_gradsync: {reason}; attach() does nothing.", GradSyncWarning, stacklevel=3)
            return
        models = list(getattr(accelerator, "_models", [])) if trainer is None else []
        self._apply_reduce_dtype(already_prepared=bool(models))
        try:
            for model in models:
                # accelerate lists DDP models unwrapped; those bind at their first no_sync().
                if accelerator.distributed_type == DistributedType.FSDP or adapt_model(model) is not None:
                    self.bind(model)
        except Exception:
            self.detach()
            raise
        # accelerate's checkpoints hold no gradients: a mid-window one gets them from us.
        self._hooks.append(accelerator.register_save_state_pre_hook(self._on_save_state))
        self._hooks.append(accelerator.register_load_state_pre_hook(self._on_load_state))
        if trainer is not None:
            from .trainer import GradSyncCallback

            self._callback = GradSyncCallback(self)
            # First in line, so the reporting callbacks (TensorBoard, W&B, ...) see our keys.
            trainer.callback_handler.callbacks.insert(0, self._callback)
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
        reduce-scatters / all-reduces issued and skipped, bytes reduced, measured held gradient
        bytes, each unit's mode; `last_step/*` for the last finished optimizer step."""
        return combined_stats(
            {self._names[key]: acc.stats() for key, acc in self._accounts.items()}, self.policy.name
        )

    def plan(self, model: Optional[nn.Module] = None) -> Optional[Plan]:
        """The plan of `model` (default: the first bound model): held units, reason."""
        if model is not None:
            return self._plans.get(id(_root(model)))
        return next(iter(self._plans.values()), None)

    def units(self, model: Optional[nn.Module] = None) -> list:
        """The units (`accel_gradsync.fsdp.Unit`) of `model` (default: the first bound model)."""
        key = id(_root(model)) if model is not None else next(iter(self._plans), None)
        adapter = self._adapters.get(key)
        return list(adapter.units) if adapter is not None else []

    def describe(self) -> str:
        """The decision line printed at start, e.g. `grad sync: deferred over 4 micro-batches ...`."""
        key = next(iter(self._plans), None)
        if key is None:
            return f"grad sync: {self.policy.name} (no FSDP/DDP model bound yet)"
        return describe_decision(self._plans[key], self._adapters[key], self.micro_batches_per_step)

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
                "use sync mode 'per_micro_batch' (GradSyncConfig(defer=False))."
            )

    def _apply_reduce_dtype(self, already_prepared: bool) -> None:
        if self.config.reduce_dtype == "auto":
            return
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None:
            warnings.warn(
                f"accel_gradsync: reduce_dtype={self.config.reduce_dtype!r} is ignored: it sets the FSDP "
                "mixed-precision policy and this run does not use FSDP.",
                GradSyncWarning,
                stacklevel=4,
            )
            return
        if already_prepared:
            raise ValueError(
                f"GradSyncConfig.reduce_dtype={self.config.reduce_dtype!r} must reach FSDP before the model "
                "is wrapped: call accel_gradsync.attach(accelerator, config) before accelerator.prepare(...)."
            )
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        policy = plugin.mixed_precision_policy
        if policy is None:
            policy = MixedPrecisionPolicy() if plugin.fsdp_version == 2 else MixedPrecision()
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=_DTYPES[self.config.reduce_dtype])

    def _hook_accelerator(self) -> None:
        handle = self
        base = type(self.accelerator)

        class GradSyncAccelerator(base):  # type: ignore[misc, valid-type]
            @contextlib.contextmanager
            def no_sync(self, model):  # accelerate's signature
                with handle._no_sync(model, super().no_sync):
                    yield

            @contextlib.contextmanager
            def accumulate(self, *models):
                with super().accumulate(*models):
                    try:
                        yield
                    except BaseException:
                        handle._abort_accumulation()
                        self.step = 0  # accelerate's window counter: the next window starts fresh
                        raise

            def prepare(self, *args, **kwargs):
                result = super().prepare(*args, **kwargs)
                # One object comes back alone; several as a tuple (a list under FSDP2).
                for obj in result if isinstance(result, (tuple, list)) else (result,):
                    if isinstance(obj, nn.Module) and (
                        self.distributed_type == DistributedType.FSDP or adapt_model(obj) is not None
                    ):
                        handle.bind(obj)
                return result

        GradSyncAccelerator.__name__ = GradSyncAccelerator.__qualname__ = f"GradSync{base.__name__}"
        setattr(GradSyncAccelerator, _HANDLE_ATTR, self)
        self._original_class = base
        self.accelerator.__class__ = GradSyncAccelerator

    def _agreed_free_memory(self) -> int:
        if self._free_memory is None:  # one collective per run, before the first step
            self._free_memory = agreed_free_memory(self.config, self.accelerator.device)
        return self._free_memory

    def bind(self, model: nn.Module) -> Optional[ModelAdapter]:
        """Inspect a prepared model once: its wrapper and units, the plan, the micro-batch counter."""
        root = _root(model)
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
            self._adapters[id(root)] = None
            return None
        self._adapters[id(root)] = adapter
        if not adapter.units:
            return adapter  # nothing trainable (a frozen reference model): no gradient to schedule
        if self.policy.name == "auto" and self.micro_batches_per_step > 1:
            # auto measures step 1 and plans from step 2 on (replan.py).
            if self._memory_probe is None:
                self._memory_probe = memory_probe(self.accelerator.device, self.config)
            planner = MeasuredAuto(self.config, self._memory_probe, self._agree_peak)
            plan = planner.first_plan()
            self._auto[id(root)] = [planner, (0, 0)]
        else:
            plan = self.policy.plan(adapter, self._agreed_free_memory, self.micro_batches_per_step)
        self._warn_about_plan(plan, adapter)
        self._hooks.append(root.register_forward_pre_hook(self._on_forward))
        self._hooks.append(root.register_forward_hook(self._after_forward))
        name = _model_name(root)
        taken = set(self._names.values())
        self._names[id(root)] = name if name not in taken else f"{name}#{len(taken) + 1}"
        self._accounts[id(root)] = SyncAccounting(
            mode=plan.mode, mode_selected=self.policy.name, wrapper=adapter.kind,
            collective=adapter.collective, hsdp=adapter.hsdp, units=len(adapter.units),
        )  # fmt: skip
        self._set_plan(root, adapter, plan)
        # One line at start, on the main process only: this model's decision and what it costs.
        self.accelerator.print(describe_decision(plan, adapter, self.micro_batches_per_step))
        return adapter

    def _set_plan(self, root: nn.Module, adapter: ModelAdapter, plan: Plan) -> None:
        self._plans[id(root)] = plan
        self._accounts[id(root)].mode = plan.mode
        self._accounts[id(root)].unit_modes = {u.name: plan.level(u) for u in adapter.units}

    def _window_key(self, root: nn.Module) -> tuple[int, int]:
        """Changes when a window of `root` ends (an optimizer step, or an aborted accumulation)."""
        acc = self._accounts[id(root)]
        return acc.optimizer_steps, acc.aborted_steps

    def _replan(self, root: nn.Module, adapter: ModelAdapter, auto: list) -> None:
        """At a window's first micro-batch: read the last step's peak; change the plan if auto says so."""
        planner, key = auto
        if key == self._window_key(root):
            return
        auto[1] = self._window_key(root)
        change = planner.at_window_start(adapter, self._plans[id(root)], self.micro_batches_per_step)
        acc = self._accounts[id(root)]
        acc.measured_peaks, acc.plan_changes = list(planner.peaks), planner.changes
        if change is not None:
            self._set_plan(root, adapter, change.plan)
            self.accelerator.print(change.message)
            self.accelerator.print(describe_decision(change.plan, adapter, self.micro_batches_per_step))

    def _agree_peak(self, peak: int, capacity: int) -> tuple[int, int]:
        """(the largest peak, the smallest capacity) over all ranks: one all-reduce per optimizer step."""
        if not (dist.is_available() and dist.is_initialized()):
            return peak, capacity
        value = torch.tensor([peak, -capacity], dtype=torch.int64, device=self.accelerator.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value[0].item()), -int(value[1].item())

    def _warn_about_plan(self, plan: Plan, adapter: ModelAdapter) -> None:
        if self.config.keep_params_unsharded and adapter.kind != "fsdp2" and plan.held:
            instead = {"fsdp1": "FSDP1's nearest equivalent is sharding_strategy SHARD_GRAD_OP",
                       "ddp": "DDP never shards parameters"}[adapter.kind]  # fmt: skip
            warnings.warn(
                f"accel_gradsync: keep_params_unsharded does not apply on {adapter.kind}: it keeps FSDP2 units' "
                f"parameters unsharded through the accumulation window ({instead}).",
                GradSyncWarning,
                stacklevel=3,
            )
        if adapter.root_only and plan.held and len(plan.held) != len(adapter.units):
            raise AssertionError(f"{adapter.kind} can only defer every unit at once")  # policies ensure it
        wide = [u for u in plan.held if u.held_dtype.itemsize > u.compute_dtype.itemsize]
        if plan.hold != ALL_REDUCE and wide and self.micro_batches_per_step > 1:
            extra = sum(u.numel * (u.held_dtype.itemsize - u.compute_dtype.itemsize) for u in wide)
            warnings.warn(
                f"accel_gradsync: deferral holds gradients in {wide[0].held_dtype} (the reduce dtype), wider "
                f"than the {wide[0].compute_dtype} compute dtype: {format_bytes(extra)} more per rank than "
                f"{wide[0].compute_dtype} would hold. Set reduce_dtype to match the params (or 'auto') to "
                "halve it, at the cost of reducing in low precision.",
                GradSyncWarning,
                stacklevel=3,
            )

    def _abort_accumulation(self) -> None:
        """An exception (KeyboardInterrupt included) left `accumulate()`: discard the window's
        gradients, held or not, so none leaks into the next one. Flags were restored on the way
        out of `no_sync`."""
        self._after_forward()
        for key, adapter in self._adapters.items():
            if adapter is not None:
                adapter.drop_held_grads()
                if key in self._plans:
                    adapter.reshard(self._plans[key].windowed)  # a window's params, gathered for nothing now
        for acc in self._accounts.values():
            acc.abort_step()
        self._warn_once(
            "abort",
            "accel_gradsync: an exception ended an accumulation window; its gradients were discarded "
            "and the next accumulate() starts a fresh window of M micro-batches.",
        )

    def _grads_file(self, directory: str) -> str:
        return os.path.join(directory, f"accel_gradsync_grads_rank{self.accelerator.process_index}.pt")

    def _on_save_state(self, models: list, weights: list, output_dir: str) -> None:
        """accelerate saves no gradients. Mid-window, save this rank's (held or sharded) ones
        next to the checkpoint, so a resumed run finishes the window exactly."""
        path = self._grads_file(output_dir)
        done = max((acc.current.micro_batches for acc in self._accounts.values()), default=0)
        state = [a.grad_state() for a in self._adapters.values() if a is not None] if done else []
        if done and all(s is not None for s in state):
            torch.save(state, path)
            return
        if os.path.exists(path):
            os.remove(path)  # a boundary checkpoint over an older mid-window one
        if done:
            self._warn_once(
                "save_state",
                f"accel_gradsync: save_state() after {done} of {self.micro_batches_per_step} micro-batches of an "
                "accumulation window: accelerate's checkpoint holds no gradients and FSDP1's cannot be put "
                "back, so a run resumed from it loses those micro-batches. Save after the optimizer step "
                "(when accelerator.sync_gradients is True) for an exact resume.",
            )

    def _on_load_state(self, models: list, input_dir: str) -> None:
        path = self._grads_file(input_dir)
        # Put back at the next micro-batch, once load_state has restored the parameters.
        self._pending_grads = torch.load(path, weights_only=True) if os.path.exists(path) else None

    def _restore_grads(self) -> None:
        adapters = [a for a in self._adapters.values() if a is not None]
        for adapter, state in zip(adapters, self._pending_grads):
            adapter.load_grad_state(state)
        self._pending_grads = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, GradSyncWarning, stacklevel=4)

    # -- hot path -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _no_sync(self, model: nn.Module, accelerate_no_sync) -> Iterator[None]:
        adapter = self.bind(model)
        if adapter is None:
            with accelerate_no_sync(model):
                yield
            return
        auto = self._auto.get(id(_root(model)))
        if auto is not None:
            self._replan(_root(model), adapter, auto)
        plan = self._plans.get(id(_root(model)))
        # The micro-batch that ends an optimizer step always syncs, whatever asked for no_sync.
        if self.accelerator.sync_gradients or plan is None or not plan.held:
            yield
            return
        held = plan.held
        if adapter.root_only:
            context = accelerate_no_sync(model)
        else:
            held = adapter.holdable(plan.held)
            if len(held) != len(plan.held):
                self._warn_once(
                    "fallback",
                    f"accel_gradsync: {len(plan.held) - len(held)} unit(s) sync this micro-batch instead of "
                    "holding: torch's FSDP2 cannot hold a gradient that must be cast to reduce_dtype for a "
                    "unit that has not run yet. They hold once they have run; gradients stay exact.",
                )
            windowed = [u for u in plan.windowed if any(u is h for h in held)]
            context = adapter.hold(held, plan.hold, windowed)
        self._held[id(_root(model))] = (held, plan.hold)
        try:
            with context:
                yield
            if adapter.even_out_held_grads(held):
                self._warn_once(
                    "even_out",
                    "accel_gradsync: some parameters got no gradient in a held micro-batch while others in "
                    "their unit did; they now hold a zero gradient in the reduce dtype so that a later "
                    "first gradient reduces correctly (torch's FSDP2 needs one dtype per unit).",
                )
        finally:
            self._held.pop(id(_root(model)), None)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # generation, evaluation, or log-prob passes without gradients
        if self._pending_grads is not None:
            self._restore_grads()
        if id(module) not in self._held and not self.accelerator.sync_gradients and self.policy.name != "per_micro_batch":
            # A non-final micro-batch that skipped no_sync: accelerate's shared sync_each_batch was
            # switched on after attach (by another Accelerator or Trainer in this process).
            if self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
                self._warn_once(
                    "sync_each_batch",
                    f"accel_gradsync: sync mode {self.policy.name!r} is not applied: accelerate's "
                    "sync_each_batch=True was set after attach() and makes every micro-batch sync.",
                )
        held, hold = self._held.get(id(module), ((), ""))
        plan = self._plans.get(id(module))
        account = self._accounts[id(module)]
        if self.accelerator.sync_gradients and account.current.deferred_micro_batches:
            # Held gradients only grow through a window: their bytes before its last forward are
            # its peak, read once per window instead of after every held backward.
            account.record_held(self._adapters[id(module)].held_grad_bytes())
        if self.accelerator.sync_gradients and plan is not None and plan.windowed:
            # The window's last forward keeps its params too, so its backward gathers nothing;
            # the backward then reshards (reshard_after_backward is back to what it was).
            self._after_forward()
            self._restore_forward = self._adapters[id(module)].keep_params_through_forward(plan.windowed)
        account.record_micro_batch(self._adapters[id(module)].units, held, hold, ends_step=self.accelerator.sync_gradients)

    def _after_forward(self, *_: Any) -> None:
        if self._restore_forward is not None:
            self._restore_forward()
            self._restore_forward = None


def _model_name(root: nn.Module) -> str:
    """The user's class name of a wrapped model (not FSDP1's wrapper or FSDP2's `FSDP<cls>`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    model = root.module if isinstance(root, FSDP1) else root
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))


def _root(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def describe_decision(plan: Plan, adapter: ModelAdapter, micro_batches: int) -> str:
    """One line: the mode, each unit's level, the collectives per optimizer step it implies and
    what it holds, gradients and params apart."""
    m = micro_batches
    plan = plan.over(m)
    rs, ar = collectives_per_step(plan, adapter.units, adapter.hsdp, m)
    every = sum(u.collectives for u in adapter.units) * m
    if adapter.collective == "all_reduce":
        cost = f"{rs} all-reduces/step instead of {every}"  # DDP: whole-model passes, bucketed
    else:
        ag, _ = all_gathers_per_step(plan, adapter, m)
        every_ag, _ = all_gathers_per_step(Plan("per_micro_batch"), adapter, m)
        if adapter.hsdp:
            cost = f"{rs} reduce-scatters, {ar} all-reduces and {ag} all-gathers/step instead of {every}, {every} and {every_ag}"
        else:
            cost = f"{rs} reduce-scatters and {ag} all-gathers/step instead of {every} and {every_ag}"
    levels = [plan.level(u) for u in adapter.units]
    counts = ", ".join(f"{levels.count(lv)} {lv.replace('_', '-')}" for lv in _LEVELS[plan.hold] if lv in levels)
    line = f"grad sync: {plan.mode} over {m} micro-batch{'es' if m != 1 else ''} on {adapter.kind} ({counts}) -> {cost}"
    if plan.held:
        dtype = str(plan.held[0].held_dtype).removeprefix("torch.")
        what = "sharded partial" if plan.hold == ALL_REDUCE else "unsharded"
        line += f"; holds ~{format_bytes(plan.held_grad_bytes())} {what} {dtype} grads"
        if plan.windowed:
            param_dtype = str(plan.windowed[0].compute_dtype).removeprefix("torch.")
            line += f" + ~{format_bytes(plan.held_param_bytes())} unsharded {param_dtype} params"
        line += " per rank"
    if plan.reason:
        line += f" [{plan.reason}]"
    return line


_LEVELS = {"gradient_sync": ("windowed", "deferred", "per_micro_batch"), ALL_REDUCE: ("defer_all_reduce", "per_micro_batch")}
