"""FSDP2's private per-unit state, read: the accessors the adapter (fsdp2.py), its held gradients
(fsdp2_grads.py) and the live counters (fsdp2_counts.py) share, and `check_fsdp2_internals`,
which refuses at bind a torch that lacks an attribute any of them reads.

FSDP2 has setters for its per-unit flags but no getters, so `sync_flags` reads them back from the
param groups the setters write; the counters read what FSDP2 issues next (a param group's
sharded and training state, its pending all-gather and reduction). Every read goes through
`compat/fsdp2.py` (`internals.read(obj, name)`), which says where each torch series keeps it.
Attribute reads only, no call into FSDP2: the counters run them before every forward and
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.compat import fsdp2_grads as held_grads
from accel_gradsync.compat.versions import describe_tested_torch
from accel_gradsync.planning.units import Unit


def as_fsdp2(module: nn.Module) -> FSDPModule:
    """A unit's module as what FSDP2 made it (`fully_shard` changes its class to FSDP<cls>)."""
    return cast(FSDPModule, module)


def state_groups(state) -> list:
    """An FSDP2 state's param groups."""
    return internals.read(state, "param_groups")


def group_params(group) -> list:
    """The FSDPParams of one param group."""
    return internals.read(group, "fsdp_params")


def sharded_param(p) -> Any:
    """An FSDPParam's sharded parameter (a DTensor)."""
    return internals.read(p, "sharded_param")


def held_grad(p) -> torch.Tensor | None:
    """The unsharded gradient an FSDPParam holds, where this torch keeps it (compat/fsdp2_grads.py:
    2.13/2.14 accumulate one cast to `reduce_dtype` apart, 2.15 on the unsharded parameter's
    `.grad`); None when it holds none."""
    return held_grads.held(p)


def grad_dtype_of(param: torch.Tensor) -> torch.dtype | None:
    """The gradient dtype a parameter asks autograd for (`Tensor.grad_dtype`, public: its own dtype
    unless set); None where it accepts any (an explicit `grad_dtype=None`)."""
    return param.grad_dtype


def param_now(p) -> nn.Parameter:
    """The parameter an FSDPParam stands for, as its module holds it now. transformers' load-time
    sharding puts the loaded weights in after `fully_shard`, and FSDP2 takes the new parameter up
    as `sharded_param` only at its lazy init (the first forward): until then `sharded_param` is
    the replaced one, whose `requires_grad` PEFT's freezing never reached."""
    info = internals.read(p, "module_info")
    return getattr(info.module, info.param_name)


def unit_params(module: FSDPModule) -> list:
    """The FSDPParams one FSDP2 unit manages directly."""
    return [p for g in state_groups(module._get_fsdp_state()) for p in group_params(g)]


def sync_flags(module: FSDPModule) -> tuple[bool, bool, bool]:
    """(requires_gradient_sync, requires_all_reduce, reshard_after_backward) of one FSDP2 unit,
    as its setters left them."""
    groups = state_groups(module._get_fsdp_state())
    return (
        all(internals.read(g, "reduce_grads") for g in groups),
        all(internals.read(g, "all_reduce_grads") for g in groups),
        all(internals.read(g, "reshard_after_backward") for g in groups),
    )


def check_fsdp2_internals(model: nn.Module) -> None:
    """Raise, naming the torch version and what is missing, when this torch's FSDP2 lacks a private
    attribute the adapter relies on where `compat/fsdp2.py` says this torch series keeps it (a
    series with no entry there is checked against the newest one)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        missing = internals.missing({internals.STATE: state})
        if missing is None:
            groups = state_groups(state)
            if not groups:
                continue
            params = group_params(groups[0])
            missing = internals.missing({internals.GROUP: groups[0], internals.PARAM: next(iter(params), None)})
        if missing is not None:
            raise RuntimeError(
                f"accel_gradsync reads FSDP2's private {missing}, which torch {torch.__version__} does not "
                f"have (tested: {describe_tested_torch()}; accel_gradsync/compat/fsdp2.py says where each keeps it). "
                "Install a tested torch, or use sync_mode 'per_micro_batch' without attach()."
            )
        return  # one unit tells: every FSDP2 state of a torch release has the same fields


# What FSDP2 issues next, for the live counters (fsdp2_counts.py).


def pending_all_gathers(unit: Unit) -> Callable[[], int]:
    """A call that says how many all-gathers FSDP2 issues for `unit` if its forward or backward
    runs now (fsdp2_counts.py): one per param group whose params are not unsharded (sharded,
    resharded to a smaller mesh after forward, or prefetched and not waited for yet); none on a
    mesh of one rank. Attribute reads only: it runs before every forward and backward."""
    groups, flag = param_groups(unit), internals.attribute("is_unsharded")
    if unit.shard_size == 1:
        return lambda: 0
    return lambda: sum(not getattr(g, flag) for g in groups)


def unsharded(group) -> bool:
    """`group`'s params are unsharded now (a prefetch not waited for yet does not count)."""
    return bool(internals.read(group, "is_unsharded"))


def param_groups(unit: Unit) -> list:
    """The unit's param groups: each post-backwards and reduces on its own."""
    return state_groups(as_fsdp2(unit.module)._get_fsdp_state())


def pending_reduction(unit: Unit, group, hsdp: bool) -> tuple[int, int, int]:
    """(reduce-scatters, all-reduces, gradient bytes) that `group`'s post-backward issues if it
    runs now: none while its sync is held; else one of each (the all-reduce under HSDP while
    not held) when it finds a gradient, held from earlier micro-batches or computed since. torch
    2.15 also reduces a zero gradient for a param with a slice of HSDP's held partial sum (a
    unit that ran in an earlier micro-batch of the window and not in this one)."""
    if not internals.read(group, "reduce_grads"):
        return 0, 0, 0
    partial = held_grads.partial_layout(group) if internals.read(group, "partial_reduce_output") is not None else None
    in_partial = {i for i, _, _ in partial or ()}
    numel = sum(
        sharded_param(p).numel()
        for i, p in enumerate(group_params(group))
        if internals.has(p, "unsharded_param") and (held_grad(p) is not None or i in in_partial)
    )
    if not numel:
        return 0, 0, 0
    all_reduces = int(hsdp and internals.read(group, "all_reduce_grads"))
    return int(unit.shard_size > 1), all_reduces, numel * unit.reduce_dtype.itemsize


def forwards_left(unit: Unit) -> bool:
    """A grouped unit (`fully_shard([a, b])`) some of whose modules did not run this forward:
    FSDP completes its post-forward in the root's, with its pre-backward on the root's outputs."""
    return bool(internals.read(as_fsdp2(unit.module)._get_fsdp_state(), "modules_to_run_forward", ()))


def unused_prefetch(unit: Unit, group) -> bool:
    """At the end of a backward: `group` was all-gathered ahead of use (a backward prefetch of a
    unit this backward does not run, e.g. the one an evaluation ran last) and nothing waited for
    it; FSDP drops it at its end-of-backward callback."""
    return unit.shard_size > 1 and internals.read(group, "all_gather_result") is not None


def ran_post_backward(group) -> bool:
    """`group` ran its post-backward in the backward in progress (FSDP's end-of-backward
    callback then skips it)."""
    return internals.read(group, "training_state").name == "POST_BACKWARD"


def post_backward_group(node) -> object | None:
    """The param group whose post-backward the autograd `node` runs (FSDP2's pre-forward puts
    one on a unit's inputs that need gradients), else None."""
    if getattr(getattr(node, "_forward_cls", None), "__name__", "") != "RegisterPostBackwardFunction":
        return None
    return getattr(node, "param_group", None)
