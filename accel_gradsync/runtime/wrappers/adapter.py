"""`ModelAdapter`: what a run reads of a wrapped model and how it holds its gradient sync.

An adapter lists a model's *units* (the modules whose gradients one collective reduces) and, for
FSDP2, holds the gradient sync of any subset of them for one micro-batch. One subclass per
wrapper (fsdp2.py, fsdp1.py, ddp.py); adapt.py picks it for a prepared model. FSDP1 and DDP can
only defer everything at once, through the root's `no_sync()`, which accelerate already calls
correctly; `root_only` tells the caller to reuse it. Planning reads an adapter as
`planning.units.Wrapped`; the estimator builds the same adapters over a meta model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from accel_gradsync.planning.units import Unit


class ModelAdapter:
    """Base adapter: the wrapper's kind, its units and how their sync is held."""

    kind: str = ""
    collective: str = "reduce_scatter"
    root_only: bool = False
    """True where deferral is all-or-nothing through the root's `no_sync()` (FSDP1, DDP)."""
    hsdp: bool = False
    """True when the mesh has a replicate dimension: gradients are also all-reduced across replicas."""
    backend: str = ""
    """The process-group backend the units reduce over ("nccl", "hccl", "gloo"; FSDP2)."""
    keeps_params_when_held: bool = False
    """FSDP1 SHARD_GRAD_OP: `no_sync()` keeps the params unsharded, so a held micro-batch skips the
    next forward's all-gather (FSDP2 does it per unit, in a window: see `FSDP2Adapter.hold`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.units: list[Unit] = self._find_units(model)
        self.replicated: list[nn.Parameter] = []
        """Trainable parameters the wrapper does not shard: FSDP2's root found under a wrapper
        holds those added after sharding (a PEFT adapter on a model transformers sharded at load
        time), which no unit reduces; transformers' Trainer all-reduces them itself."""

    @property
    def trainable(self) -> bool:
        """Some unit, or a parameter outside the units, has a gradient to sync (a frozen reference
        model has none)."""
        return any(not u.frozen for u in self.units) or bool(self.replicated)

    def _find_units(self, model: nn.Module) -> list[Unit]:
        raise NotImplementedError

    def hold(
        self, units: Sequence[Unit], what: str = "gradient_sync", windowed: Sequence[Unit] = ()
    ) -> contextlib.AbstractContextManager:
        """Skip the sync of `units` for the enclosed forward and backward: the whole
        `gradient_sync`, or (HSDP) only the cross-replica `all_reduce`; keep the params of the
        `windowed` ones unsharded through it (FSDP2)."""
        raise NotImplementedError

    def keep_params_through_forward(self, units: Sequence[Unit]) -> Callable[[], None]:
        """Before the last micro-batch's forward: keep the params of `units` unsharded through it,
        so its backward gathers nothing. Returns the call that restores the flags after forward."""
        return lambda: None

    def reshard(self, units: Sequence[Unit]) -> None:
        """Free the unsharded params of `units` (after an aborted window)."""

    def reshard_left_gathered(self, optimizer: torch.optim.Optimizer) -> list[Unit]:
        """After `optimizer` stepped: reshard every unit of this model a forward left unsharded
        (none kept for the run) whose parameters it updated; returns them. FSDP2 only: its next
        forward would run on their unsharded copy from before the step."""
        return []

    def unit_modules(self) -> list[tuple[nn.Module, Unit]]:
        """Every module FSDP2 runs a unit's pre-forward on, with its unit (a grouped
        `fully_shard([a, b])` unit has several); empty for other wrappers."""
        return []

    def reshard_unless_kept(self, units: Sequence[Unit]) -> list[Unit]:
        """Reshard those of `units` whose flags say they reshard after forward; returns them."""
        return []

    def unsharded_now(self) -> frozenset[int]:
        """The `id` of each unit whose params are unsharded right now, where the live counters
        need it (FSDP1: a forward without gradients leaves the root gathered); empty elsewhere."""
        return frozenset()

    def reshards_now(self, unit: Unit) -> bool:
        """The unit's flags say it reshards after its next forward (a window or generation can
        keep it; `unit.reshards_after_forward` is what it was given)."""
        return unit.reshards_after_forward

    def reset_after_exception(self) -> bool:
        """Reset the wrapper after an exception inside a forward; False where it cannot."""
        return False

    def holdable(self, units: Sequence[Unit]) -> list[Unit]:
        """The `units` whose sync can be held on this micro-batch (all, unless a wrapper says not)."""
        return list(units)

    def even_out_held_grads(self, units: Sequence[Unit]) -> int:
        """Make held gradients safe to reduce together later (see FSDP2); 0 where nothing to do."""
        return 0

    def drop_held_grads(self) -> None:
        """Discard every gradient of an aborted accumulation: `.grad`, and what the wrapper holds
        elsewhere (FSDP2's unsharded and accumulated gradients, HSDP partial sums)."""
        self.model.zero_grad(set_to_none=True)

    def grad_state(self) -> list | None:
        """This rank's gradients of the window in progress, wherever the wrapper keeps them, for
        a mid-window checkpoint; None where the wrapper cannot give them back."""
        return [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def load_grad_state(self, state: list) -> None:
        """Put `grad_state()`'s gradients back before the window continues."""
        for p, grad in zip(self.model.parameters(), state, strict=True):
            p.grad = None if grad is None else grad.to(p.device)

    def held_grad_bytes(self) -> int:
        """Bytes of unsharded gradient the wrapper holds right now, read from the tensors it
        keeps (sizes only: no device synchronisation)."""
        raise NotImplementedError


def dim0_shard_numel(shape: Sequence[int], shard_size: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter: dim 0 padded to a multiple of the shard size."""
    if not shape:
        return 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // shard_size) * rest
