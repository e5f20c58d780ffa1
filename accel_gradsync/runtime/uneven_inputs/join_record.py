"""What a `join()` loop (join.py) did in one micro-batch, recorded so that a rank which left can do
it again with its outputs x 0: `Iteration` (the forwards of the bound models, their inputs
detached, and each `accelerator.backward` between them) and `replay`.

An iteration is one `accelerate.accumulate()` block where the loop uses it; in a loop that does
not (accelerate's basic loop: forward, `backward`, `optimizer.step()`), everything from a forward
to the next optimizer step. Replaying runs the same forwards of the same models, and a backward of
their outputs x 0 where the loop called `accelerator.backward`, inside `accumulate()` of the same
models where the loop entered it: so accelerate's window, the plan and FSDP's and DDP's
collectives are the training ranks'.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from accel_gradsync.runtime.core.state import root_of


@dataclass
class Forward:
    """One recorded forward: the module the hook saw, its inputs, its grad mode."""

    module: nn.Module
    args: tuple
    kwargs: dict
    grad: bool


@dataclass
class Backward:
    """`accelerator.backward` of what the forwards before it computed."""


@dataclass
class Iteration:
    """One micro-batch of the loop: inside `accumulate(*models)` or (`models` None) outside."""

    models: tuple | None
    events: list[Forward | Backward] = field(default_factory=list)

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.events.append(Forward(module, _detached(args), _detached(kwargs), torch.is_grad_enabled()))

    def backward(self) -> None:
        self.events.append(Backward())

    def backed(self) -> bool:
        """A backward ran in the iteration."""
        return any(isinstance(e, Backward) for e in self.events)

    def forwards_after_last_backward(self) -> bool:
        """A forward with gradients after the iteration's last backward, with none after it."""
        last = max((i for i, e in enumerate(self.events) if isinstance(e, Backward)), default=None)
        return last is not None and any(isinstance(e, Forward) and e.grad for e in self.events[last + 1 :])


@contextlib.contextmanager
def replay(accelerator: Accelerator, iteration: Iteration) -> Iterator[None]:
    """`iteration` again, its outputs x 0: inside `accumulate()` of its models where it ran there
    (the block stays open until the caller leaves this one), each backward where it had one (or
    one at the end, where the loop called `loss.backward()` itself)."""
    models = iteration.models or ()
    by_root = {root_of(m): m for m in [*accelerator._models, *models]}  # DDP: its wrapper
    window = accelerator.accumulate(*models) if iteration.models is not None else contextlib.nullcontext()
    with window:
        outputs: list[torch.Tensor] = []
        backwards = 0
        for event in iteration.events:
            if isinstance(event, Backward):
                _backward_zero(accelerator, outputs)
                outputs, backwards = [], backwards + 1
                continue
            with torch.set_grad_enabled(event.grad):
                out = by_root.get(event.module, event.module)(*event.args, **event.kwargs)
            if event.grad:
                outputs += [t for t in tensors_of(out) if t.requires_grad]
        if not backwards:
            _backward_zero(accelerator, outputs)
        yield


def forward_again(iteration: Iteration, root: nn.Module) -> None:
    """`root`'s first recorded forward of `iteration` once more, its output dropped: what a rank
    that left issues where the others forward that model for a metric (the collectives are the
    model's, whatever the inputs)."""
    event = next(e for e in iteration.events if isinstance(e, Forward) and root_of(e.module) is root)
    event.module(*event.args, **event.kwargs)


def _backward_zero(accelerator: Accelerator, outputs: list[torch.Tensor]) -> None:
    if outputs:
        accelerator.backward(torch.stack([t.float().sum() for t in outputs]).sum() * 0.0)


def _detached(tree: Any) -> Any:
    """Inputs as recorded: tensors detached (no graph kept alive) in tuples, lists and dicts."""
    if torch.is_tensor(tree):
        return tree.detach()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_detached(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    return tree


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, tuples, lists, dicts (transformers' ModelOutput)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in tensors_of(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    return []


def holds_generation_cache(tree: Any) -> bool:
    """A transformers KV cache (`Cache`) among a forward's inputs, in tuples, lists and dicts: a
    generation's forward, which grows the cache in place, so its recorded call cannot run again."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache is None:
        return False  # transformers not loaded: no model here generates with its cache

    def holds(node: Any) -> bool:
        if isinstance(node, (tuple, list)):
            return any(holds(v) for v in node)
        if isinstance(node, dict):
            return any(holds(v) for v in node.values())
        return isinstance(node, cache)

    return holds(tree)


def zeros_like_tree(tree: Any, device: torch.device) -> Any:
    """What a rank that left contributes to a collective the loop issues itself (a loss gathered
    for logging): zeros in the tree's shapes and dtypes, as DDP's `Join` does, on `device` where
    the loop's tensor was on an accelerator (each rank's own). `tree` is `spec`'s."""
    kind = tree[0]
    if kind == "tensor":
        return torch.zeros(tree[1], dtype=getattr(torch, tree[2]), device=device if tree[3] else "cpu")
    if kind in ("tuple", "list"):
        values = [zeros_like_tree(v, device) for v in tree[1]]
        return tuple(values) if kind == "tuple" else values
    return {k: zeros_like_tree(v, device) for k, v in tree[1]}


def spec(tree: Any) -> Any:
    """`tree`'s shape for `zeros_like_tree`; None where it holds anything but tensors."""
    if torch.is_tensor(tree):
        return ("tensor", tuple(tree.shape), str(tree.dtype).removeprefix("torch."), tree.device.type != "cpu")
    if isinstance(tree, (tuple, list)):
        items = [spec(v) for v in tree]
        return None if None in items else (type(tree).__name__, items)
    if isinstance(tree, dict):
        pairs = [(k, spec(v)) for k, v in tree.items()]
        return None if any(v is None for _, v in pairs) else ("dict", pairs)
    return None
