"""What the worker measures, from the real run: collectives and the bytes they send, gradient
bytes held between micro-batches, and the process's peak resident memory.

Collectives are counted by wrapping the `torch.distributed` functions FSDP/DDP call (they look
them up on the module at call time), and their bytes come from the tensors actually passed,
with the ring formula, so the number follows what the run did rather than a cost model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from accel_gradsync.memory import peak_rss_bytes, reset_peak_rss  # noqa: F401 (the worker's memory readings)

# name -> (tensor argument whose size defines the traffic, bytes sent per rank per byte of it
# on a ring of n ranks). all_gather: each rank sends its shard to n-1 peers = (n-1)/n of the
# output; reduce_scatter: (n-1)/n of the input; all_reduce = reduce_scatter + all_gather.
_RING: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
}
# Report names: collectives grouped by what they do, whatever function FSDP picked.
KIND = {
    "all_gather_single": "all_gathers",
    "all_gather_into_tensor": "all_gathers",
    "reduce_scatter_single": "reduce_scatters",
    "reduce_scatter_tensor": "reduce_scatters",
    "all_reduce": "all_reduces",
}


class CollectiveMeter:
    """Counts collectives by kind and sums the bytes this rank sends, until `take()`."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.bytes_sent = 0.0
        self.enabled = True
        self._originals = {}
        for name, (arg, factor) in _RING.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            self._wrap(name, original, arg, factor)

    def _wrap(self, name: str, original: Callable, arg: str, factor: Callable[[int], float]) -> None:
        signature = inspect.signature(original)
        meter = self

        def wrapped(*args, **kwargs):
            if meter.enabled:
                bound = signature.bind(*args, **kwargs)
                tensor = bound.arguments[arg]
                group = bound.arguments.get("group")
                n = dist.get_world_size(group)
                meter.counts[KIND[name]] += 1
                meter.bytes_sent += factor(n) * tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        setattr(dist, name, wrapped)

    @contextlib.contextmanager
    def paused(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def take(self) -> dict:
        """Counts and bytes since the last take."""
        out = {k: self.counts.get(k, 0) for k in ("reduce_scatters", "all_reduces", "all_gathers")}
        out["bytes_sent"] = self.bytes_sent
        self.counts, self.bytes_sent = Counter(), 0.0
        return out


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
        grads = [getattr(fp, "unsharded_accumulated_grad", None), None if unsharded is None else unsharded.grad,
                 None if sharded is None else getattr(sharded, "_local_tensor", sharded)]  # fmt: skip
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


def handle_held_bytes(stats: dict) -> tuple[str, float] | None:
    """The plugin's own measured held-gradient bytes, if this version reports them:
    (stats key, value). Prefers the last finished step's value (this segment's M) over a peak
    since attach (which spans every M the configuration ran)."""
    keys = [k for k, v in stats.items() if "held" in k and "byte" in k and isinstance(v, (int, float))]
    if not keys:
        return None
    keys.sort(key=lambda k: (not k.startswith("last_step/"), k))
    return keys[0], float(stats[keys[0]])


def device_peak_bytes(device: str) -> int | None:
    """Device allocator peak since the last reset, on CUDA/NPU; None on CPU."""
    backend = getattr(torch, device, None) if device in ("cuda", "npu") else None
    return None if backend is None else int(backend.max_memory_allocated())


def reset_device_peak(device: str) -> None:
    backend = getattr(torch, device, None) if device in ("cuda", "npu") else None
    if backend is not None:
        backend.reset_peak_memory_stats()
