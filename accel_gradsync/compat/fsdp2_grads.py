"""Where each torch series keeps one FSDPParam's deferred (held) gradient, and how it is read,
put back and cleared: the part of `runtime/wrappers/fsdp2_grads.py` that differs by release.

- torch 2.13, 2.14: the unsharded parameter's `.grad` in the compute dtype; a gradient to be cast
  to `reduce_dtype` moves after each held backward to `FSDPParam.unsharded_accumulated_grad`
  (`to_accumulated_grad_if_needed`), where later micro-batches' gradients are added to it, and
  the reduce-scatter takes it from there.
- torch 2.15: only the unsharded parameter's `.grad`, already in its held dtype (FSDP2 casts it at
  the end of each held backward and lets autograd add into it); `unsharded_accumulated_grad` is
  a read-only property forwarding there. The unsharded parameter exists from the unit's first
  all-gather on, so a gradient put back before then needs one (`put` says so).

Each function goes through `compat/fsdp2.py`'s table; none decides by version itself.
"""

from __future__ import annotations

from typing import Any

import torch

from accel_gradsync.compat import fsdp2 as internals


def held(p: Any) -> torch.Tensor | None:
    """The unsharded gradient FSDPParam `p` holds now, wherever this torch keeps it; None: none."""
    if not internals.release().holds_in_grad:
        grad = internals.read(p, "unsharded_accumulated_grad")
        if grad is not None:
            return grad
    unsharded = internals.read(p, "unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def put(p: Any, grad: torch.Tensor | None) -> bool:
    """Make `grad` what `p` holds, for FSDP2 to add the next micro-batches to and reduce-scatter
    at the window's end. False where this torch keeps it on an unsharded parameter `p` does not
    have yet (2.15 before the unit's first all-gather): gather the unit, then put it again."""
    if not internals.release().holds_in_grad:
        # 2.13/2.14 add later gradients to the accumulated one, whatever the dtypes, and reduce it.
        internals.write(p, "unsharded_accumulated_grad", grad)
        return True
    unsharded = internals.read(p, "unsharded_param", None)
    if unsharded is None:
        return grad is None
    unsharded.grad = grad  # its grad_dtype (FSDP2 sets it to the held dtype) admits a wider gradient
    return True


def clear(p: Any) -> None:
    """Drop what `p` holds (an aborted accumulation's gradient, which `zero_grad` cannot reach)."""
    if not internals.release().holds_in_grad:
        internals.write(p, "unsharded_accumulated_grad", None)
    unsharded = internals.read(p, "unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None


def partial_layout(group: Any) -> list[tuple[int, int, int]] | None:
    """Where this torch keeps one (2.15): which param each slice of `group`'s held HSDP partial
    sum belongs to, as (index in the group's params, offset, size); None where it keeps none."""
    if "partial_reduce_output_layout" not in internals.layout():
        return None
    index = {id(p): i for i, p in enumerate(internals.read(group, "fsdp_params"))}
    layout = internals.read(group, "partial_reduce_output_layout")
    return [(index[id(p)], offset, size) for p, (offset, size) in layout.items()]


def put_partial(group: Any, partial: torch.Tensor | None, layout: list | None) -> None:
    """Make `partial` (`partial_layout`'s `layout`) `group`'s held HSDP partial sum."""
    internals.write(group, "partial_reduce_output", partial)
    if layout is not None and "partial_reduce_output_layout" in internals.layout():
        params = internals.read(group, "fsdp_params")
        internals.write(
            group, "partial_reduce_output_layout", {params[i]: (offset, size) for i, offset, size in layout}
        )
