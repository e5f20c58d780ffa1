"""Adapters over the three wrappers: FSDP2 (`fully_shard`), FSDP1 (`FullyShardedDataParallel`), DDP.

An adapter lists a model's *units* (the modules whose gradients one collective reduces) and,
for FSDP2, holds the gradient sync of any subset of them for one micro-batch. FSDP1 and DDP
can only defer everything at once, through the root's `no_sync()`, which accelerate already
calls correctly; `root_only` tells the caller to reuse it.

FSDP2 has setters for its per-unit flags but no getters (torch 2.13), so `_sync_flags` reads
them back from the param groups the setters write. That read, and FSDP1's flat-parameter
size, are the only private torch attributes this package touches; nothing is assigned.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True, eq=False)
class Unit:
    """One gradient-reducing unit of a wrapped model."""

    name: str
    """Qualified module name ("" for the root)."""
    module: nn.Module
    numel: int
    """Trainable elements whose unsharded gradient this unit holds when its sync is deferred."""
    collectives: int
    """Collectives one sync of the unit issues (FSDP: reduce-scatters, one per param group)."""


class ModelAdapter:
    """Base adapter: the wrapper's kind, its units and how their sync is held."""

    kind: str = ""
    collective: str = "reduce_scatter"
    root_only: bool = False
    """True where deferral is all-or-nothing through the root's `no_sync()` (FSDP1, DDP)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.units: list[Unit] = self._find_units(model)

    def _find_units(self, model: nn.Module) -> list[Unit]:
        raise NotImplementedError

    def hold(self, units: Sequence[Unit]) -> contextlib.AbstractContextManager:
        """Skip the sync of `units` for the enclosed forward and backward."""
        raise NotImplementedError


class FSDP2Adapter(ModelAdapter):
    """`fully_shard` models: every `FSDPModule` with trainable parameters is a unit, and its
    sync can be held on its own with `set_requires_gradient_sync(False, recurse=False)`."""

    kind = "fsdp2"

    def _find_units(self, model: nn.Module) -> list[Unit]:
        units = []
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            numel = sum(
                p.sharded_param.numel()  # a DTensor: numel() is the global, unsharded size
                for g in groups
                for p in g.fsdp_params
                if p.sharded_param.requires_grad
            )
            if numel:
                units.append(Unit(name, module, numel, collectives=len(groups)))
        return units

    @contextlib.contextmanager
    def hold(self, units: Sequence[Unit]) -> Iterator[None]:
        # Save every unit, not only the held ones: a unit the user switched off before the
        # step must come back switched off, and an exception must not leave anything held.
        saved = [(u.module, _sync_flags(u.module)) for u in self.units]
        try:
            for u in units:
                u.module.set_requires_gradient_sync(False, recurse=False)
            yield
        finally:
            for module, (reduce_grads, all_reduce_grads) in saved:
                module.set_requires_gradient_sync(reduce_grads, recurse=False)
                module.set_requires_all_reduce(all_reduce_grads, recurse=False)


class FSDP1Adapter(ModelAdapter):
    """`FullyShardedDataParallel` models: one unit per FSDP instance that owns a flat parameter.
    `no_sync()` is only valid on the root and keeps the unsharded flat gradient in the compute
    dtype; under SHARD_GRAD_OP it also keeps the parameters unsharded."""

    kind = "fsdp1"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        units = []
        for name, module in model.named_modules():
            handle = getattr(module, "_handle", None) if isinstance(module, FSDP1) else None
            if handle is not None and handle.flat_param.requires_grad:
                units.append(Unit(name, module, handle.flat_param._unpadded_unsharded_size.numel(), 1))
        return units


class DDPAdapter(ModelAdapter):
    """`DistributedDataParallel`: the whole model is one unit, all-reduced in buckets whose
    count DDP decides at the first backward; `no_sync()` skips all of them."""

    kind = "ddp"
    collective = "all_reduce"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return [Unit("", model, numel, collectives=1)]


def adapt_model(model: nn.Module) -> Optional[ModelAdapter]:
    """The adapter for a prepared model, or None when it is not wrapped for data parallelism."""
    if isinstance(model, FSDPModule):
        return FSDP2Adapter(model)
    if isinstance(model, FSDP1):
        return FSDP1Adapter(model)
    if isinstance(model, DistributedDataParallel):
        return DDPAdapter(model)
    return None


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """True when the model or any submodule is sharded by FSDP1 or FSDP2."""
    return any(isinstance(m, (FSDPModule, FSDP1)) for m in model.modules())


def _sync_flags(module: FSDPModule) -> tuple[bool, bool]:
    """(requires_gradient_sync, requires_all_reduce) of one FSDP2 unit, as its setters left them."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return all(g.reduce_grads for g in groups), all(g.all_reduce_grads for g in groups)


def sync_flags(model: nn.Module) -> dict[str, tuple[bool, bool]]:
    """Every FSDP2 unit's (requires_gradient_sync, requires_all_reduce), by module name."""
    return {n: _sync_flags(m) for n, m in model.named_modules() if isinstance(m, FSDPModule)}
