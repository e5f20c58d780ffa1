"""The gradients FSDP2 holds while a unit's sync is held, outside `.grad`: counted
(`held_bytes`), evened out (`even_out`), dropped (`drop`), saved and put back for a mid-window
checkpoint (`save`, `load`). torch has no API to read or put back a held gradient or HSDP's
`partial_reduce_output`: those go through `compat/fsdp2.py` and, for what each release does
with a held gradient, `compat/fsdp2_grads.py`. The writes are where torch would otherwise give
wrong gradients or crash: `even_out` (torch 2.13/2.14's uniform-dtype assertion; 2.15 reduces
mixed dtypes), `drop` (gradients of an aborted accumulation that `zero_grad` cannot reach;
2.15's public `reset_iter_state()` drops them itself) and `load` (a window resumed mid-step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.compat import fsdp2_grads as held_grads
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers.fsdp2_state import (
    as_fsdp2,
    group_params,
    held_grad,
    param_groups,
    sharded_param,
    unit_params,
)


def held_bytes(units: Sequence[Unit]) -> int:
    """Bytes of unsharded gradient FSDP2 holds for `units` right now (sizes only)."""
    total = 0
    for unit in units:
        for group in param_groups(unit):
            # HSDP with the all-reduce held: the sharded partial sum of the reduce-scatters.
            partial = internals.read(group, "partial_reduce_output")
            if partial is not None:
                total += partial.numel() * partial.element_size()
            for p in group_params(group):
                grad = held_grad(p)
                if grad is not None:
                    total += grad.numel() * grad.element_size()
    return total


def even_out(units: Sequence[Unit]) -> int:
    """After a held backward: in each unit whose held gradients are cast to `reduce_dtype`,
    give the params that got no gradient yet a zero one in that dtype, so a first gradient
    on a later micro-batch joins a uniform reduce-scatter (torch 2.13/2.14 assert "FSDP
    reduce-scatter expects uniform gradient dtype" otherwise; 2.15 reduces mixed dtypes, and
    nothing is filled). Returns how many it filled. Such a param then ends the step with a zero
    gradient rather than None."""
    if internals.release().holds_in_grad:
        return 0
    filled = 0
    for unit in units:
        if unit.held_dtype == unit.compute_dtype:
            continue
        params = unit_params(as_fsdp2(unit.module))
        if not any(internals.read(p, "unsharded_accumulated_grad") is not None for p in params):
            continue
        for p in params:
            if (
                internals.read(p, "unsharded_accumulated_grad") is None
                and internals.has(p, "unsharded_param")
                and internals.read(p, "unsharded_param").grad is None
                and sharded_param(p).requires_grad
            ):
                zeros = torch.zeros(
                    internals.read(p, "orig_size"), dtype=unit.held_dtype, device=sharded_param(p).device
                )
                internals.write(p, "unsharded_accumulated_grad", zeros)
                filled += 1
    return filled


def drop(units: Sequence[Unit], root: nn.Module) -> None:
    """Discard what FSDP2 holds of an aborted accumulation outside `.grad`: the unsharded and
    accumulated gradients, and HSDP's partial sums. Where `reset_iter_state()` discards them
    (torch 2.15), the public reset of `root` (the FSDP root, which it must be called on) does,
    and it also waits for and forgets whatever the aborted forward or backward left in flight;
    a model that holds nothing (a frozen reference model) is left as it is, its kept params too."""
    if internals.release().reset_drops_held_grads:
        if held_bytes(units):
            cast(FSDPModule, root).reset_iter_state()
        return
    for unit in units:
        for group in param_groups(unit):
            internals.write(group, "partial_reduce_output", None)
            for p in group_params(group):
                held_grads.clear(p)


def save(units: Sequence[Unit]) -> list:
    """Copies of what FSDP2 holds for `units` mid-window, per param group: (unsharded, sharded)
    gradients per param, the partial sum, and (torch 2.15) which param each slice of the
    partial sum is."""
    state = []
    for unit in units:
        for group in param_groups(unit):
            params = []
            for p in group_params(group):
                held = held_grad(p)
                sharded = sharded_param(p).grad
                params.append(
                    (
                        None if held is None else held.detach().clone(),
                        None if sharded is None else sharded.to_local().detach().clone(),
                    )
                )
            partial = internals.read(group, "partial_reduce_output")
            state.append(
                (params, None if partial is None else partial.detach().clone(), held_grads.partial_layout(group))
            )
    return state


def load(units: Sequence[Unit], state: list) -> None:
    """Put `save()`'s gradients back into `units` before the window continues. Where this torch
    keeps a held gradient on the unsharded parameter and a unit has none yet (2.15, resumed in a
    fresh process), the unit is gathered once with the public `unshard()` and resharded."""
    groups = [(u, g) for u in units for g in param_groups(u)]
    if len(groups) != len(state):
        raise ValueError(
            f"the checkpoint's window gradients are for {len(state)} FSDP2 param groups, this model has "
            f"{len(groups)}: it was saved from a different model or wrapping. Load it into the model it was "
            "saved from, or delete its accel_gradsync_grads_rank*.pt files to resume at the last optimizer step."
        )
    for (unit, group), (params, partial, *layout) in zip(groups, state, strict=True):
        held_grads.put_partial(group, partial, layout[0] if layout else None)  # saved before 2.15: no layout
        for p, (held, sharded) in zip(group_params(group), params, strict=True):
            if not held_grads.put(p, held):
                module = as_fsdp2(unit.module)
                module.unshard()  # creates the unsharded parameters; their data is freed again below
                module.reshard()
                if not held_grads.put(p, held):
                    raise RuntimeError(f"FSDP2 gave unit {unit.name or '<root>'} no unsharded parameter to hold in")
            if sharded is not None:
                _put_sharded_grad(p, sharded)


def _put_sharded_grad(p, sharded: torch.Tensor) -> None:
    """Give FSDPParam `p`'s sharded parameter the local shard `sharded` of its gradient."""
    from torch.distributed.tensor import DTensor

    sp = sharded_param(p)
    sp.grad = DTensor.from_local(
        sharded.to(sp.device),
        sp.device_mesh,
        sp.placements,
        run_check=False,
        shape=sp.shape,
        stride=sp.stride(),
    )
