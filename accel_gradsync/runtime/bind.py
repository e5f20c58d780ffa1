"""`Binder.bind`: inspect a prepared model once, the first time it is seen (at `prepare`, the
Trainer's train start, or its first `no_sync`): its wrapper and units (fsdp.py), its first plan
(planning/policies.py; planning/replan.py under `auto`), its counters, the decision line, and the
window's and generation's hooks on it. Binding waits for `prepare` because only the wrapped model
says what its units, dtypes and mesh are; a model accelerate did not wrap is remembered as such,
so accelerate's own `no_sync` keeps applying to it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, is_compiled_module
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import SyncMode
from accel_gradsync.planning.memory import MemoryProbe, agreed_free_memory, memory_probe
from accel_gradsync.planning.replan import Forecast, Forecaster, MeasuredAuto
from accel_gradsync.runtime.accounting import SyncAccounting
from accel_gradsync.runtime.decision import describe_decision, warn_about_plan
from accel_gradsync.runtime.fsdp import ModelAdapter, adapt_model, is_fsdp_wrapped
from accel_gradsync.runtime.generation import GenerationGather
from accel_gradsync.runtime.state import Attachment, BoundModel, root_of
from accel_gradsync.runtime.window import Window


def wants_binding(accelerator: Accelerator, model: nn.Module) -> bool:
    """A prepared model to bind now: any under FSDP (bind refuses one left unwrapped), else one
    accelerate wrapped in DDP (it lists DDP models unwrapped: those bind at their first no_sync)."""
    return accelerator.distributed_type == DistributedType.FSDP or adapt_model(model) is not None


class Binder:
    """Binds models into one `Attachment` and watches them (the window's and generation's hooks);
    keeps what planning reads once per run (free memory, the memory probe)."""

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
        self._probe = probe
        self._forecaster = forecaster
        self._free_memory: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def bind(self, model: nn.Module) -> ModelAdapter | None:
        """Adapt, plan, count and watch `model` the first time it is seen; its adapter (None where
        it is not wrapped)."""
        root = root_of(model)
        if root in self.state.adapters:
            return self.state.adapters[root]
        adapter = self._bind(model)
        if root in self.state.bound:
            self._handles += self.window.watch(root)
            self._handles += self.generation.watch(root)
        return adapter

    def close(self) -> None:
        """Detach: remove every hook binding put on the models."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _bind(self, model: nn.Module) -> ModelAdapter | None:
        state, root = self.state, root_of(model)
        adapter = adapt_model(model)
        expects_fsdp = state.accelerator.distributed_type == DistributedType.FSDP
        # accelerate's FSDP shards the model it prepares at its root: an FSDP2 root found inside
        # it means the model around it is not sharded.
        if expects_fsdp and (adapter is None or adapter.kind == "ddp" or adapter.model is not root):
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
                stacklevel=4,  # the code that called GradSyncHandle.bind
            )
            state.adapters[root] = None
            return None
        state.adapters[root] = adapter
        if not adapter.trainable:
            return adapter  # nothing trainable (a frozen reference model): no gradient to schedule
        m, auto = state.micro_batches_per_step, None
        if state.policy.name == SyncMode.AUTO and m > 1:
            # auto plans step 1 from the forecast, or measures step 1 and plans from step 2 on (replan.py).
            if self._probe is None:
                self._probe = memory_probe(state.accelerator.device, state.config)
            auto = MeasuredAuto(state.settings, self._probe, self._agree_peak)
            forecast = None
            if state.settings.forecasts:
                forecast = (
                    self._forecaster.forecast(model, m)
                    if self._forecaster is not None
                    else Forecast(None, "no forecaster: attach() passes one")
                )
            plan = auto.first_plan(adapter, m, forecast)
        else:
            plan = state.policy.plan(adapter, self._agreed_free_memory, m)
        warn_about_plan(plan, adapter, state.settings, m)
        name, taken = model_name(root), {b.name for b in state.bound.values()}
        name = name if name not in taken else f"{name}#{len(taken) + 1}"
        account = SyncAccounting(
            state.policy.name, adapter.kind, adapter.collective, hsdp=adapter.hsdp, units=len(adapter.units)
        )
        state.bound[root] = BoundModel(name, adapter, plan, account, auto)
        # One line at start, on the main process only: this model's decision and what it costs.
        state.accelerator.print(describe_decision(plan, adapter, m))
        return adapter

    def _agreed_free_memory(self) -> int:
        if self._free_memory is None:  # one collective per run, before the first step
            self._free_memory = agreed_free_memory(self.state.config, self.state.accelerator.device)
        return self._free_memory

    def _agree_peak(self, peak: int, capacity: int) -> tuple[int, int]:
        """(the largest peak, the smallest capacity) over all ranks: one all-reduce per optimizer step."""
        if not (dist.is_available() and dist.is_initialized()):
            return peak, capacity
        value = torch.tensor([peak, -capacity], dtype=torch.int64, device=self.state.accelerator.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value[0].item()), -int(value[1].item())


def model_name(root: nn.Module) -> str:
    """The user's class name of a wrapped model (not FSDP1's wrapper, FSDP2's `FSDP<cls>` or
    torch.compile's `OptimizedModule`, which accelerate's dynamo_backend puts inside FSDP2 and
    around FSDP1 and DDP)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    model: nn.Module = root
    while isinstance(model, (FSDP1, DistributedDataParallel)) or is_compiled_module(model):
        inner = model._orig_mod if is_compiled_module(model) else model.module
        assert isinstance(inner, nn.Module)  # what each wrapper wraps
        model = inner
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))
