"""`FSDP1Adapter`: the units of a `FullyShardedDataParallel` model, one per FSDP instance that
owns a flat parameter. FSDP1 defers only through the root's `no_sync()` (`root_only`), which
accelerate calls; the adapter reads each unit's sizes, dtypes and strategy, and the flat gradient
`no_sync()` leaves unsharded, from FSDP1's `FlatParamHandle`.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from accel_gradsync.planning.costs import unit_dtypes
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


class FSDP1Adapter(ModelAdapter):
    """`FullyShardedDataParallel` models: one unit per FSDP instance that owns a flat parameter
    (a frozen one too).
    `no_sync()` is only valid on the root and keeps the unsharded flat gradient in the compute
    dtype; under SHARD_GRAD_OP it also keeps the parameters unsharded."""

    kind = "fsdp1"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        units = []
        for name, module in model.named_modules():
            handle = getattr(module, "_handle", None) if isinstance(module, FSDP1) else None
            if handle is not None:
                # A frozen flat parameter reduces nothing but is all-gathered all the same.
                param_numel = handle.flat_param._unpadded_unsharded_size.numel()
                numel = param_numel if handle.flat_param.requires_grad else 0
                policy = module.mixed_precision
                held, reduce, compute = unit_dtypes(
                    "fsdp1", handle.flat_param.dtype, policy.param_dtype, policy.reduce_dtype
                )
                shard = handle.world_size if handle.uses_sharded_strategy else 1
                full_shard = handle._sharding_strategy.name in ("FULL_SHARD", "HYBRID_SHARD")
                # SHARD_GRAD_OP keeps params unsharded after forward, and under no_sync after backward.
                self.keeps_params_when_held = (
                    self.keeps_params_when_held or handle._sharding_strategy.name == "SHARD_GRAD_OP"
                )
                units.append(
                    Unit(
                        name,
                        module,
                        numel,
                        int(numel > 0),
                        held_dtype=held,
                        reduce_dtype=reduce,
                        compute_dtype=compute,
                        shard_size=shard,
                        sharded_numel=-(-numel // shard),
                        param_numel=param_numel,
                        reshards_after_forward=full_shard and name != "",
                    )
                )
        return units

    def drop_held_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for unit in self.units:
            _flat_param(unit).grad = None

    def unsharded_now(self) -> frozenset[int]:
        # NOTE: needs_unshard() is False once the padded unsharded storage exists (and for NO_SHARD);
        # it reads `_full_param_padded`, which FSDP1 creates at its lazy init (the first forward).
        return frozenset(
            id(u)
            for u in self.units
            if hasattr(_flat_param(u), "_full_param_padded") and not _handle(u).needs_unshard()
        )

    def grad_state(self) -> None:
        return None  # FSDP1's flat gradient views cannot be put back from outside

    def held_grad_bytes(self) -> int:
        # Under no_sync FSDP1 leaves the unsharded flat gradient on `flat_param.grad`.
        total = 0
        for unit in self.units:
            grad = _flat_param(unit).grad
            if grad is not None:
                total += grad.numel() * grad.element_size()
        return total


def _handle(unit: Unit) -> Any:
    """The `FlatParamHandle` of one FSDP1 unit (every unit has one: `_find_units` keeps only those)."""
    handle = cast(FSDP1, unit.module)._handle
    assert handle is not None
    return handle


def _flat_param(unit: Unit) -> nn.Parameter:
    """The flat parameter one FSDP1 unit owns."""
    return _handle(unit).flat_param
