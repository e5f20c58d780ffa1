"""`Unit`: one FSDP unit (or DDP's whole model) of a wrapped model.

The adapters find units (fsdp.py), the policies plan over them (policies.py) and the counters
count their collectives (accounting.py). The type lives on its own so that each of those
imports it from here rather than from one another.

A *frozen* unit has no trainable parameter (the root holding frozen embeddings and head under
LoRA, a frozen tower): it reduces nothing and holds no gradient, but it all-gathers its
parameters in every forward like any other unit, so the all-gather counts, the window and the
memory for generation include it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn


class Level(str, enum.Enum):
    """What a plan does with one unit on the micro-batches that do not end an optimizer step."""

    PER_MICRO_BATCH = "per_micro_batch"
    """Reduce-scatter every micro-batch."""
    DEFERRED = "deferred"
    """Hold the gradient sync (`set_requires_gradient_sync(False)`): one reduce-scatter per step."""
    WINDOWED = "windowed"
    """Deferred, and the params kept unsharded through the window: one all-gather per step."""
    DEFER_ALL_REDUCE = "defer_all_reduce"
    """HSDP: reduce-scatter every micro-batch, hold the cross-replica all-reduce."""
    FROZEN = "frozen"
    """Nothing to reduce (no trainable parameter) and not windowed."""

    def __str__(self) -> str:  # the name itself in messages, logs and JSON (`enum.StrEnum` from 3.11)
        return self.value


@dataclass(frozen=True, eq=False)
class Unit:
    """One FSDP unit of a wrapped model (DDP: the whole model), trainable or frozen."""

    name: str
    """Qualified module name ("" for the root)."""
    module: nn.Module
    numel: int
    """Trainable elements whose unsharded gradient this unit holds when its sync is deferred
    (0: a frozen unit)."""
    collectives: int
    """Collectives one sync of the unit issues (FSDP: reduce-scatters, one per param group with
    trainable parameters; 0 for a frozen unit)."""
    held_dtype: torch.dtype = torch.float32
    """dtype of the unsharded gradient held between deferred micro-batches."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype the gradient is reduce-scattered in."""
    compute_dtype: torch.dtype = torch.float32
    """dtype of the unsharded parameters forward and backward run in."""
    shard_size: int = 1
    """Ranks the unit's parameters are sharded over (1 for DDP)."""
    sharded_numel: int = 0
    """Elements of one rank's shard, padding included (FSDP2 pads dim 0 to the shard size)."""
    param_numel: int = 0
    """Elements of all the unit's parameters, frozen ones included: what one all-gather brings
    together (0: the same as `numel`)."""
    reshards_after_forward: bool = False
    """The unit frees its unsharded params after forward, so backward all-gathers them again
    (FSDP2 `reshard_after_forward`, FSDP1 FULL_SHARD; never the root, whose params backward
    needs at once)."""

    def __post_init__(self) -> None:
        if self.param_numel == 0:
            object.__setattr__(self, "param_numel", self.numel)  # frozen dataclass: set once, here

    @property
    def frozen(self) -> bool:
        """No trainable parameter: nothing to reduce or hold, only parameters to gather."""
        return self.numel == 0

    @property
    def param_bytes(self) -> int:
        """Bytes of this unit's unsharded parameters, frozen ones included (what keeping them
        unsharded costs)."""
        return self.param_numel * self.compute_dtype.itemsize

    @property
    def held_bytes(self) -> int:
        """Bytes this unit holds per rank while its sync is deferred."""
        return self.numel * self.held_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes of the unsharded gradient one sync of this unit reduces."""
        return self.numel * self.reduce_dtype.itemsize


def micro_batch_all_gathers(
    unit: Unit, gathered: bool, kept_through_forward: bool, kept_after_backward: bool
) -> tuple[int, bool]:
    """(parameter all-gathers, params still unsharded after) of one unit over one micro-batch's
    forward and backward: its forward gathers unless the params are still unsharded from before;
    its backward gathers again when the forward resharded them (`reshard_after_forward`, unless
    a window keeps them through this forward); after backward they stay only where a window (or
    FSDP1 SHARD_GRAD_OP under `no_sync()`) keeps them. The decision line, the estimate (through
    `step_all_gathers`) and FSDP1's live counters (accounting.py) count with it."""
    count = (0 if gathered else 1) + (1 if unit.reshards_after_forward and not kept_through_forward else 0)
    return count, kept_after_backward


def step_all_gathers(unit: Unit, micro_batches: int, kept_through_forward: bool, kept_between: bool) -> int:
    """Parameter all-gathers of one unit over an optimizer step of `micro_batches`, counted with
    `micro_batch_all_gathers` in constant time, so that any M answers at once: the first
    micro-batch starts sharded; every micro-batch between the first and the last finds the params
    as the one before left them (`kept_between`) and leaves them so, so they all gather alike; the
    last one's backward reshards. `kept_through_forward`: a window keeps the params through every
    forward; `kept_between`: they stay unsharded after every backward but the last (a window, or
    FSDP1 SHARD_GRAD_OP under `no_sync()`)."""

    def one(gathered: bool, last: bool) -> tuple[int, bool]:
        return micro_batch_all_gathers(unit, gathered, kept_through_forward, kept_between and not last)

    if micro_batches == 1:
        return one(False, True)[0]
    first, gathered = one(False, False)
    between, _ = one(gathered, False)  # leaves the params as it found them
    last, _ = one(gathered, True)
    return first + (micro_batches - 2) * between + last


def no_grad_forward_all_gathers(unit: Unit, gathered: bool, kept: bool) -> tuple[int, bool]:
    """(all-gathers, params still unsharded after) of one unit over a forward without gradients
    (generation, evaluation): no backward follows, so a unit that does not reshard after forward
    (FSDP2's root) or that is `kept` (`gather_for_generation`) stays unsharded."""
    return (0 if gathered else 1), kept or not unit.reshards_after_forward
