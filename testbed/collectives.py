"""The collective counter the benchmarks' workers and the multi-rank tests' workers share.

It wraps the `torch.distributed` functions FSDP/DDP call (they look them up on the module at call
time) and takes the bytes from the tensors actually passed, with the ring formula, so the numbers
follow what the run did rather than a cost model. It imports torch only, so a worker can create
the counter before anything else it imports issues a collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

# name -> (kind, the tensor argument whose size defines the traffic, ring factor f: a rank sends
# f x (n-1)/n of that tensor's bytes on n ranks: all-gather's output, reduce-scatter's input, and
# all-reduce = reduce-scatter + all-gather of its tensor). `all_gather` takes its output as a list
# of tensors, one per rank: FSDP1 gathers a CPU flat parameter with it.
_RING: dict[str, tuple[str, str, int]] = {
    "all_gather": ("all_gathers", "tensor_list", 1),
    "all_gather_single": ("all_gathers", "output_tensor", 1),
    "all_gather_into_tensor": ("all_gathers", "output_tensor", 1),
    "reduce_scatter_single": ("reduce_scatters", "input", 1),
    "reduce_scatter_tensor": ("reduce_scatters", "input", 1),
    "all_reduce": ("all_reduces", "tensor", 2),
}
KIND = {name: kind for name, (kind, _, _) in _RING.items()}  # report names, whatever function FSDP picked


@dataclass
class Traffic:
    """Collectives by kind, and the bytes this rank sent in them (ring formula)."""

    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gathers: int = 0
    bytes_sent: float = 0.0


class CollectiveCounter:
    """Counts real collectives and the bytes this rank sends in them (one per process): `counts`, the
    calls per function name since the last `take()`; `paused()` stops counting."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes_sent, self.enabled = 0.0, True
        for name, (_, arg, factor) in _RING.items():
            self._wrap(name, getattr(dist, name), arg, factor)

    def _wrap(self, name: str, original: Callable, arg: str, factor: int) -> None:
        signature, counter = inspect.signature(original), self

        def counted(*args, **kwargs):
            if counter.enabled:
                bound = signature.bind(*args, **kwargs)
                tensors, n = bound.arguments[arg], dist.get_world_size(bound.arguments.get("group"))
                size = sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, list) else [tensors]))
                counter.counts[name] += 1
                counter.bytes_sent += factor * (n - 1) / n * size
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    @contextlib.contextmanager
    def paused(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def take(self) -> dict[str, int]:
        """Calls per function name since the last take (or `take_traffic`), and start over."""
        out, self.counts, self.bytes_sent = dict(self.counts), Counter(), 0.0
        return out

    def take_traffic(self) -> Traffic:
        """Collectives by kind and bytes sent since the last take, and start over."""
        traffic = Traffic(bytes_sent=self.bytes_sent)
        for name, calls in self.take().items():
            setattr(traffic, KIND[name], getattr(traffic, KIND[name]) + calls)
        return traffic
