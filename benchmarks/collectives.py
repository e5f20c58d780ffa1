"""The collective counter the benchmarks' workers and the multi-rank tests' workers share.

Collectives are counted by wrapping the `torch.distributed` functions FSDP/DDP call (they look
them up on the module at call time), and their bytes come from the tensors actually passed, with
the ring formula, so the numbers follow what the run did rather than a cost model. The module
imports torch only, so a worker can create the counter before anything else it imports issues a
collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

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


@dataclass
class Traffic:
    """Collectives by kind, and the bytes this rank sent in them (ring formula)."""

    reduce_scatters: int = 0
    """Reduce-scatters issued."""
    all_reduces: int = 0
    """All-reduces issued."""
    all_gathers: int = 0
    """All-gathers issued."""
    bytes_sent: float = 0.0
    """Bytes this rank sent, from the sizes of the tensors the collectives were given."""


class CollectiveCounter:
    """Counts real `torch.distributed` collectives, and the bytes this rank sends in them, by
    wrapping the module's functions FSDP1 and FSDP2 call (they look them up on the module at call
    time). One per process: the benchmarks' workers and the multi-rank tests' workers use it.

    `counts` holds the calls per function name since the last `take()`; `paused()` stops counting
    (a reference computation's collectives)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes_sent = 0.0
        self.enabled = True
        for name, (arg, factor) in _RING.items():
            self._wrap(name, getattr(dist, name), arg, factor)

    def _wrap(self, name: str, original: Callable, arg: str, factor: Callable[[int], float]) -> None:
        signature = inspect.signature(original)
        counter = self

        def counted(*args, **kwargs):
            if counter.enabled:
                bound = signature.bind(*args, **kwargs)
                tensor = bound.arguments[arg]
                n = dist.get_world_size(bound.arguments.get("group"))
                counter.counts[name] += 1
                counter.bytes_sent += factor(n) * tensor.numel() * tensor.element_size()
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
        sent = self.bytes_sent
        traffic = Traffic(bytes_sent=sent)
        for name, calls in self.take().items():
            setattr(traffic, KIND[name], getattr(traffic, KIND[name]) + calls)
        return traffic
