"""What both workers measure from the real tensors and the process, besides the collectives
(`collectives.py`): gradient and unsharded parameter bytes held between micro-batches, peak
memory, and the rank's pinning and versions."""

from __future__ import annotations

import os

import psutil
import torch
import torch.distributed as dist
from torch import nn

from accel_gradsync.planning.memory import peak_rss_bytes, reset_peak_rss

__all__ = ["peak_rss_bytes", "reset_peak_rss"]  # re-exported: the workers' memory readings


def pin_to_core() -> int:
    """Pin this rank to one core of those it may use (local rank mod count), as each rank owns its
    device on a GPU node. Unpinned, the ranks' main, autograd and gloo threads migrate between the
    cores and every collective waits on whichever rank the scheduler last moved."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def versions(*extra: str) -> dict[str, str]:
    """Versions of torch, accelerate, transformers, accel_gradsync and `extra` packages, and the backend."""
    import importlib

    import accel_gradsync

    names = ("torch", "accelerate", "transformers", *extra)
    out = {name: importlib.import_module(name).__version__ for name in names}
    return {**out, "accel_gradsync": accel_gradsync.__version__, "backend": dist.get_backend()}


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
    is allocated (FSDP2 frees it by resizing the storage to 0 when it reshards)."""
    total = 0
    for fp in fsdp2_params(model):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.untyped_storage().size() > 0:
            total += unsharded.numel() * unsharded.element_size()
    return total


def _local_nbytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _backend(device: str):
    return getattr(torch, device, None) if device in ("cuda", "npu") else None


def start_memory(device: str) -> dict:
    """Reset the peaks at a step's start; what `rss_growth_bytes` is measured from."""
    scoped = reset_peak_rss()
    if (backend := _backend(device)) is not None:
        backend.reset_peak_memory_stats()
    return {"scoped": scoped, "rss_before": psutil.Process().memory_info().rss}


def device_peak_bytes(device: str) -> int | None:
    """Device allocator peak since the last reset, on CUDA/NPU; None on CPU."""
    backend = _backend(device)
    return None if backend is None else int(backend.max_memory_allocated())


def synchronize(device: str) -> None:
    if (backend := _backend(device)) is not None:
        backend.synchronize()
