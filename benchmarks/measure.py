"""What the workers measure from the real tensors, besides the collectives (`collectives.py`):
gradient and unsharded parameter bytes held between micro-batches, and peak memory."""

from __future__ import annotations

import torch
from torch import nn

from accel_gradsync.planning.memory import peak_rss_bytes, reset_peak_rss  # noqa: F401 (the worker's memory readings)


def fsdp2_params(model: nn.Module) -> list:
    """Every FSDP2 `FSDPParam` of the model, once (torch 2.13's private param groups)."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    seen.setdefault(id(fp), fp)
    return list(seen.values())


def held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds right now, from the real tensors: sharded gradients plus
    every unsharded (deferred) gradient FSDP2 keeps between micro-batches. FSDP2 has no public
    getter for the deferred gradient, so this reads its `FSDPParam` fields (torch 2.13)."""
    params = fsdp2_params(model)
    if not params:  # not FSDP2 (DDP, plain): every .grad is whole
        return sum(_local_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    total = 0
    for fp in params:
        unsharded, sharded = getattr(fp, "_unsharded_param", None), fp.sharded_param.grad
        grads = [
            getattr(fp, "unsharded_accumulated_grad", None),
            None if unsharded is None else unsharded.grad,
            None if sharded is None else getattr(sharded, "_local_tensor", sharded),
        ]
        total += sum(_local_nbytes(g) for g in grads if g is not None)
    return total


def held_param_bytes(model: nn.Module) -> int:
    """Unsharded parameter bytes this rank holds right now: FSDP2 params whose unsharded storage
    is allocated (FSDP2 frees it by resizing the storage to 0 when it reshards). Between
    micro-batches that is what a window keeps (and the root, which FSDP2 never reshards after
    forward, until the backward that reshards it)."""
    total = 0
    for fp in fsdp2_params(model):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.untyped_storage().size() > 0:
            total += unsharded.numel() * unsharded.element_size()
    return total


def _local_nbytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def device_peak_bytes(device: str) -> int | None:
    """Device allocator peak since the last reset, on CUDA/NPU; None on CPU."""
    backend = getattr(torch, device, None) if device in ("cuda", "npu") else None
    return None if backend is None else int(backend.max_memory_allocated())


def reset_device_peak(device: str) -> None:
    backend = getattr(torch, device, None) if device in ("cuda", "npu") else None
    if backend is not None:
        backend.reset_peak_memory_stats()
