"""`Binder.bind`: inspect a prepared model once, the first time it is seen (at `prepare`, the
Trainer's train start, or its first `no_sync`): its wrapper and units (adapt.py), its first plan
(planning/policies.py; planning/replan.py under `auto`), its counters, the decision line, and the
window's and generation's hooks on it. Binding waits for `prepare` because only the wrapped model
says what its units, dtypes and mesh are; a model accelerate did not wrap is remembered as such,
so accelerate's own `no_sync` keeps applying to it. An FSDP2 model nothing trains (a reference
model: prepared with no trainable parameter, or held by the Trainer besides its model, as TRL
shards it itself) is bound as a `FrozenModel`: its all-gathers counted apart, its units kept across a pass of forwards
without gradients where that costs no more peak than one of them (generation.py), or for the whole
run where `keep_reference_unsharded` or the planned mode's memory says so (planning/residency.py). Frozen models bind
first where the binder can see them (a Trainer's attributes, one `prepare` call), because budget and
auto plan the trained models within memory less what those keep; one bound later re-plans them.
What a model trains is read again between windows (`Binder.refresh`): a model whose parameters'
`requires_grad` changed is bound again (a reference model becomes a trained one; a trained one is
planned for the units it trains now). FSDP2 sets each unsharded parameter's `requires_grad` from
its sharded one at every all-gather and drops the unsharded one at reshard, so a change made while
a unit is unsharded (a resident model, a root after a forward without backward) would be lost:
binding again reshards every unit of the model first and carries the flags the user set over to
the sharded parameters (`reshard_keeping_flags`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import SyncMode
from accel_gradsync.planning.memory import MemoryProbe
from accel_gradsync.planning.replan import Forecast, Forecaster, MeasuredAuto
from accel_gradsync.planning.residency import decide_residency
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.core.accounting import SyncAccounting
from accel_gradsync.runtime.core.agreement import RankMemory
from accel_gradsync.runtime.core.decision import describe_frozen, frozen_keeps, warn_about_plan
from accel_gradsync.runtime.core.fsdp2_counts import watch_fsdp2
from accel_gradsync.runtime.core.state import Attachment, BoundModel, FrozenModel, Removable, root_of
from accel_gradsync.runtime.generating.generation import GenerationGather
from accel_gradsync.runtime.wrappers.adapt import adapt_model, is_fsdp_wrapped, model_name
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


def wants_binding(accelerator: Accelerator, model: nn.Module) -> bool:
    """A prepared model to bind now: any under FSDP (bind refuses one left unwrapped), else one
    accelerate wrapped in DDP (it lists DDP models unwrapped: those bind at their first no_sync)."""
    return accelerator.distributed_type == DistributedType.FSDP or adapt_model(model) is not None


class Binder:
    """Binds models into one `Attachment` and watches them (the window's and generation's hooks);
    `memory` holds what planning reads of memory, once per run (free memory, the probe)."""

    def __init__(
        self,
        state: Attachment,
        window: Window,
        generation: GenerationGather,
        probe: MemoryProbe | None = None,
        forecaster: Forecaster | None = None,
    ) -> None:
        self.state = state
        self.window = window
        self.generation = generation
        self.memory = RankMemory(state.settings, state.accelerator.device, state.control, probe)
        self._forecaster = forecaster
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._trainer_seen = False
        self._forecasts: dict[nn.Module, Forecast] = {}
        """auto's step-1 forecast per trained model, kept for a plan made again (`_replan_for`)."""
        self._watching: dict[nn.Module, list[Removable]] = {}
        """By bound or frozen model: the hooks on it, removed when it is bound again (`refresh`)."""
        self._trainable: dict[nn.Module, tuple[nn.Module, tuple[bool, ...]]] = {}
        """By model bound: the model as bound and `requires_grad` of each of its parameters then
        (`refresh`)."""

    def bind(self, model: nn.Module) -> ModelAdapter | None:
        """Adapt, plan, count and watch `model` the first time it is seen; its adapter (None where
        it is not wrapped). The first call with a Trainer also binds the frozen FSDP2 models it holds."""
        root = root_of(model)
        if not self._handles:  # the optimizer step hooks, shared by every model
            self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer_step))
            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer_step))
        if self.state.trainer is not None and not self._trainer_seen:
            # Before the trained model's plan, which budget and auto make within what they keep.
            self._trainer_seen = True
            for attribute, frozen in frozen_models_of(self.state.trainer, model):
                if frozen not in self.state.adapters:
                    self._bind_frozen(frozen, name=attribute)
        if root in self.state.adapters:
            self.refresh(root)  # a no_sync: perhaps a window's first micro-batch
            return self.state.adapters[root]
        adapter = self._bind(model)
        self._watch(root)
        return adapter

    def refresh(self, model: nn.Module) -> None:
        """Bind `model` again where the `requires_grad` of its parameters changed since it was
        bound (progressive unfreezing, a model frozen whole): a reference model given trainable
        parameters becomes a trained model (planned, counted, its decision line printed); a
        trained model is planned again for the units it trains now (frozen whole, it stays a
        trained model with every unit frozen: its counters go on). Read at each `no_sync` or
        `accumulate()` of the model outside a window (a trained model: a window's first; a frozen
        one: each, since no step of its own marks its windows) and before each optimizer step
        (where a window ran neither: it counts from the next window), never inside a window."""
        root = root_of(model)
        bound = self.state.bound.get(root)
        if root not in self._trainable:
            return
        if bound is not None and (bound.hold is not None or bound.account.current.micro_batches):
            return  # inside a window: its plan stays to its end
        model, trainable = self._trainable[root]
        if trainable_params(root) != trainable:
            self._rebind(model)

    def close(self) -> None:
        """Detach: remove every hook binding put on the models."""
        for handle in [*self._handles, *(h for handles in self._watching.values() for h in handles)]:
            handle.remove()
        self._handles.clear()
        self._watching.clear()
        self.window.close()

    def _watch(self, root: nn.Module) -> None:
        """The window's and generation's hooks on the bound model `root` (a frozen one gets its own)."""
        if root in self.state.bound:
            self._watching.setdefault(root, []).extend(self.window.watch(root) + self.generation.watch(root))

    def _rebind(self, model: nn.Module) -> None:
        """`model`'s trainable parameters changed, at a window boundary: unwatch it and bind it
        again under the name it had. A trained model keeps its counters; a reference model's go
        into the trained model's totals."""
        root = root_of(model)
        with resharded_keeping_flags(root):  # the next all-gather carries what the user set, where it set it
            self.generation.release(models=[root], resident=True)  # flags it kept back (resident too)
            self.state.residency.review(root)  # a kept unit given trainable parameters reshards again
        for handle in self._watching.pop(root, []):
            handle.remove()
        old = self.state.bound.pop(root, None) or self.state.frozen.pop(root, None)
        del self.state.adapters[root]
        if old is None:  # an FSDP1 or DDP model bound with nothing trainable: no name or counters yet
            self._bind(model)
        else:
            self._bind(model, name=old.name, account=old.account if isinstance(old, BoundModel) else None)
        self._watch(root)
        new = self.state.bound.get(root) or self.state.frozen.get(root)
        if old is not None and new is not None and new.account is not old.account:
            new.account.total.add(old.account.total)

    def _bind(self, model: nn.Module, name: str = "", account: SyncAccounting | None = None) -> ModelAdapter | None:
        """Adapt, plan, count and print `model`; `name` and `account` where it is bound again
        (`_rebind`): a trained model given its `account` stays one, all its units frozen or not."""
        state, root = self.state, root_of(model)
        adapter = adapt_prepared(state.accelerator, model)
        if adapter is None:
            state.adapters[root] = None
            return None
        state.adapters[root] = adapter
        self._trainable[root] = (model, trainable_params(root))
        if state.settings.keep_frozen_unsharded is True and adapter.kind == "ddp":  # FSDP1: refused at attach
            state.warn_once(
                "keep_frozen_unsharded_not_fsdp2",
                "accel_gradsync: keep_frozen_unsharded is ignored on ddp: DDP keeps every parameter unsharded "
                "already; the setting keeps FSDP2 units of frozen parameters unsharded across steps.",
            )
        if not adapter.trainable and account is None:  # a frozen reference model: no gradient to schedule
            if adapter.kind == "fsdp2":
                self._bind_frozen(root, adapter, name)
            elif state.settings.keep_reference_unsharded is True:
                state.warn_once(
                    "residency_not_fsdp2",
                    f"accel_gradsync: keep_reference_unsharded=true is ignored for {model_name(model)} on "
                    f"{adapter.kind}: it keeps an FSDP2 model nothing trains unsharded ("
                    + ("DDP replicates it anyway)." if adapter.kind == "ddp" else "use fsdp_version: 2)."),
                )
            return adapter
        m, auto = state.micro_batches_per_step, None
        if state.policy.name == SyncMode.AUTO and m > 1:
            # auto plans step 1 from the forecast, or measures step 1 and plans from step 2 on (replan.py).
            auto = MeasuredAuto(state.settings, self.memory.probe, self.memory.agree_peak)
            if state.settings.forecasts:
                self._forecasts[root] = (
                    self._forecaster.forecast(model, m, [u.name for u in adapter.units if u.resident])
                    if self._forecaster is not None
                    else Forecast(None, "no forecaster: attach() passes one")
                )
        plan = self._plan(root, adapter, auto)
        warn_about_plan(plan, adapter, state.settings, m)
        name = name or unique_name(root, self.state)
        account = account or SyncAccounting(
            state.policy.name, adapter.kind, adapter.collective, hsdp=adapter.hsdp, units=len(adapter.units)
        )
        state.bound[root] = BoundModel(name, adapter, plan, account, auto)
        # One line at start, on the main process only: this model's decision and what it costs.
        state.accelerator.print(state.describe(state.bound[root]))
        return adapter

    def _plan(self, root: nn.Module, adapter: ModelAdapter, auto: MeasuredAuto | None) -> Plan:
        """The first plan of the trained model `root`, within memory less what the frozen models
        bound so far keep (`FrozenModel.kept_bytes`) and its own resident units
        (`keep_frozen_unsharded`)."""
        m = self.state.micro_batches_per_step
        reserved = sum(f.kept_bytes for f in self.state.frozen.values())
        reserved += sum(u.param_bytes for u in adapter.units if u.resident)
        if auto is not None:
            return auto.first_plan(adapter, m, self._forecasts.get(root), reserved)
        return self.state.policy.plan(adapter, self.memory.free, m, reserved)

    def _replan_for(self, frozen: FrozenModel) -> None:
        """A frozen model that keeps more than one forward gathers, bound after a trained model
        budget or auto planned and before its first micro-batch: plan that model again."""
        if not frozen.kept_bytes or self.state.policy.name not in (SyncMode.BUDGET, SyncMode.AUTO):
            return
        for root, bound in self.state.bound.items():
            if not bound.started:
                bound.take_plan(self._plan(root, bound.adapter, bound.auto))
                self.state.accelerator.print(self.state.describe(bound))

    def _bind_frozen(self, root: nn.Module, adapter: ModelAdapter | None = None, name: str = "") -> None:
        """An FSDP2 model nothing trains (`FrozenModel`): count its all-gathers and watch its
        forwards without gradients. Keeping its units across a pass of them costs no more peak than
        one of those forwards where it is one unit (the forward gathers the whole model anyway), so
        that is the default; wrapped per unit, keeping them all holds the whole unsharded model,
        which only `gather_for_generation` asks for."""
        adapter = adapter or adapt_model(root)
        self.state.adapters[root] = adapter  # seen: bind() does not adapt it again
        if adapter is None or adapter.kind != "fsdp2" or not adapter.units:
            return
        self._trainable[root] = (root, trainable_params(root))
        taken = sum(f.kept_bytes for f in self.state.frozen.values() if f.resident)
        unsharded = sum(u.param_bytes for u in adapter.units)
        residency = decide_residency(self.state.settings, unsharded, self.memory.free, taken)
        keeps = residency.resident or frozen_keeps(adapter.units, self.state.settings.gather_for_generation)
        account = SyncAccounting(self.state.policy.name, adapter.kind, adapter.collective, units=len(adapter.units))
        # Named by the Trainer's attribute (`ref_model`) where found there, else by its class.
        frozen = FrozenModel(name or unique_name(root, self.state), adapter, account, keeps, residency.resident)
        self.state.frozen[root] = frozen
        self.state.accelerator.print(describe_frozen(frozen.name, model_name(root), adapter, keeps, residency))
        # Its all-gathers as FSDP2 issues them; its step ends at every optimizer step (no
        # micro-batch of it is ever recorded: `_after_optimizer_step`).
        self._watching[root] = watch_fsdp2(adapter, account) + self.generation.watch(root)
        self._replan_for(frozen)

    def _before_optimizer_step(self, optimizer: object, args: object, kwargs: object) -> None:
        """A model whose trainable parameters changed in a window with no `no_sync` or
        `accumulate()` to see it is bound again here, for the next window."""
        for root in list(self._trainable):
            self.refresh(root)

    def _after_optimizer_step(self, optimizer: object, args: object, kwargs: object) -> None:
        for frozen in self.state.frozen.values():
            frozen.account.end_step()


def trainable_params(root: nn.Module) -> tuple[bool, ...]:
    """`requires_grad` of each of the model's parameters, in order: what `refresh` compares."""
    return tuple(p.requires_grad for p in root.parameters())


@contextlib.contextmanager
def resharded_keeping_flags(root: nn.Module) -> Iterator[None]:
    """Read the `requires_grad` each parameter of `root` shows now (the unsharded one's, where a
    unit is unsharded), run the block (which may reshard), then reshard every FSDP2 unit of
    `root` and give each sharded parameter the flag read. Between windows only: nothing is held
    then. FSDP1 and DDP keep their parameters in place: nothing to carry over."""
    flags = {name: p.requires_grad for name, p in root.named_parameters()}
    yield
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()  # NOTE: one unit each, not the units inside it
    for name, p in root.named_parameters():
        if units and p.requires_grad != flags[name]:
            p.requires_grad_(flags[name])


def adapt_prepared(accelerator: Accelerator, model: nn.Module) -> ModelAdapter | None:
    """`adapt_model` for a model to bind: a ValueError where the accelerate config asks for FSDP
    and the model is not sharded at its root; None, with a warning at the line that called
    `GradSyncHandle.bind`, where it is not wrapped at all."""
    adapter = adapt_model(model)
    # accelerate's FSDP shards the model it prepares at its root: an FSDP2 root found inside it
    # means the model around it is not sharded.
    if accelerator.distributed_type == DistributedType.FSDP and (
        adapter is None or adapter.kind == "ddp" or adapter.model is not root_of(model)
    ):
        raise ValueError(
            f"The accelerate config asks for FSDP but the prepared model ({model_name(model)}) is "
            f"{'only partly FSDP-wrapped' if is_fsdp_wrapped(model) else 'not FSDP-wrapped'}: it "
            "would train unsharded. Pass the model through `accelerator.prepare` (the Trainer does), "
            "and check the fsdp auto-wrap policy in the accelerate config."
        )
    if adapter is None:
        warnings.warn(
            f"accel_gradsync: the prepared model ({model_name(model)}) is not wrapped in FSDP or "
            "DDP, so it has no gradient sync to schedule; accelerate's own no_sync() applies.",
            GradSyncWarning,
            stacklevel=5,  # here, Binder._bind, Binder.bind, GradSyncHandle.bind, its caller
        )
    return adapter


def frozen_models_of(trainer: Any, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(attribute, model) of each FSDP2 model `trainer` holds besides the one it trains (`model`).
    NOTE: TRL's trainers shard a reference model themselves (trl.models.prepare_fsdp), not through
    accelerator.prepare, and leave its parameters requiring gradients: this is how one is found."""
    trained = {root_of(m) for m in (trainer.model, trainer.model_wrapped, model)}
    return [
        (attribute, value)
        for attribute, value in list(vars(trainer).items())
        if isinstance(value, nn.Module) and isinstance(value, FSDPModule) and value not in trained
    ]


def unique_name(root: nn.Module, state: Attachment) -> str:
    """The user's class name, `#n`-suffixed for the n-th model of that class bound in `state`
    (trained or frozen: one namespace, the keys of stats())."""
    name = model_name(root)
    taken = {b.name for b in state.bound.values()} | {f.name for f in state.frozen.values()}
    n = 1
    while (f"{name}#{n}" if n > 1 else name) in taken:
        n += 1
    return f"{name}#{n}" if n > 1 else name
