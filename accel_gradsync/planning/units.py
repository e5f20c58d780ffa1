"""The vocabulary every layer shares: `Unit` (one FSDP unit, or DDP's whole model), `Level` (what a
plan does with a unit), `Plan` (a policy's frozen decision) and `Wrapped` (what planning reads of
a wrapped model). runtime/wrappers/adapter.py finds units, policies.py plans over them, runtime/core/accounting.py
counts their collectives; they all import these from here rather than from one another.

A *frozen* unit has no trainable parameter (the root holding frozen embeddings and head under
LoRA, a frozen tower): it reduces nothing and holds no gradient, but it all-gathers its
parameters in every forward like any other unit, so the all-gather counts, the window and the
memory for generation include it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from accel_gradsync.config.settings import SyncMode


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
    resident: bool = False
    """A frozen unit that never reshards (FSDP2, `keep_frozen_unsharded`): gathered at its first
    forward of the run, then never; no all-gather in any step after the first."""

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


class Wrapped(Protocol):
    """What planning reads of a wrapped model: `runtime.adapter.ModelAdapter` provides it from a
    live model, the estimator from a meta one."""

    @property
    def kind(self) -> str:
        """ "fsdp2", "fsdp1" or "ddp"."""

    @property
    def collective(self) -> str:
        """A unit's gradient sync: "reduce_scatter" (FSDP) or "all_reduce" (DDP)."""

    @property
    def hsdp(self) -> bool:
        """The mesh has a replicate dimension (gradients also all-reduced across replicas)."""

    @property
    def keeps_params_when_held(self) -> bool:
        """A held micro-batch keeps the params unsharded (FSDP1 SHARD_GRAD_OP)."""

    @property
    def units(self) -> Sequence[Unit]:
        """Every unit, frozen ones included, in forward order."""


GRADIENT_SYNC = "gradient_sync"  # skip reduce-scatter (and all-reduce): set_requires_gradient_sync(False)


ALL_REDUCE = "all_reduce"  # HSDP: reduce-scatter, skip the cross-replica all-reduce: set_requires_all_reduce(False)


NOTHING_TO_DEFER = "one micro-batch per optimizer step: nothing to defer"


@dataclass(frozen=True)
class Plan:
    """What a policy decided for one model: each unit's level. Immutable: a change of plan is a
    new `Plan` (`dataclasses.replace`), and two plans are the same when their fields are.

    - per micro-batch (not in `held`): reduce-scatter every micro-batch, 0 bytes held;
    - deferred (`held`): reduce-scatter once per step, holds the unit's unsharded gradient;
    - windowed (`held` and `windowed`, FSDP2): also keep the unit's params unsharded from the
      window's first forward to its last backward, so it all-gathers once per step; holds the
      unsharded gradient and the unsharded params (compute dtype).
    """

    mode: str
    held: Sequence[Unit] = ()
    """Units whose sync is held on non-final micro-batches (kept as a tuple)."""
    held_sync: str = GRADIENT_SYNC
    """What the held units skip: their whole gradient sync (`GRADIENT_SYNC`), or on HSDP only the
    cross-replica all-reduce (`ALL_REDUCE`)."""
    windowed: Sequence[Unit] = ()
    """Held units whose params stay unsharded for the whole window (a subset of `held`; a tuple;
    over one micro-batch, `over(1)`, nothing is held and the window is that micro-batch)."""
    reason: str = ""
    generation_bytes: int = 0
    """Unsharded parameter bytes per rank held while generating (`gather_for_generation`: every
    unit's params in the compute dtype; 0 when off)."""

    def __post_init__(self) -> None:
        # Sequences given as lists (the policies build them so) are kept as tuples: immutable.
        object.__setattr__(self, "held", tuple(self.held))
        object.__setattr__(self, "windowed", tuple(self.windowed))

    def held_grad_bytes(self) -> int:
        """Gradient bytes per rank the held units keep between micro-batches. For an
        `all_reduce` hold only a sharded partial sum."""
        if self.held_sync == ALL_REDUCE:
            return sum(u.sharded_numel * u.held_dtype.itemsize for u in self.held)
        return sum(u.held_bytes for u in self.held)

    def held_param_bytes(self) -> int:
        """Unsharded parameter bytes per rank the windowed units keep through the window."""
        return sum(u.param_bytes for u in self.windowed)

    def held_bytes(self) -> int:
        """Everything the plan keeps per rank between micro-batches: gradients and params."""
        return self.held_grad_bytes() + self.held_param_bytes()

    def level(self, unit: Unit) -> Level:
        """`per_micro_batch`, `deferred`, `windowed`, (HSDP) `defer_all_reduce`, or `frozen` for a
        unit with nothing to reduce that is not windowed."""
        if any(u is unit for u in self.windowed):
            return Level.WINDOWED
        if unit.frozen:
            return Level.FROZEN
        if not any(u is unit for u in self.held):
            return Level.PER_MICRO_BATCH
        return Level.DEFER_ALL_REDUCE if self.held_sync == ALL_REDUCE else Level.DEFERRED

    def over(self, micro_batches: int) -> Plan:
        """This plan as it plays out over `micro_batches` per optimizer step: with one, every
        micro-batch ends its step and syncs, so a deferring mode holds no gradient; its windowed
        units still keep their params from that micro-batch's forward to its backward (window.py),
        so they stay windowed, held by nothing."""
        if micro_batches > 1 or self.mode == SyncMode.PER_MICRO_BATCH:
            return self
        kept = "; the windowed units keep their params from forward to backward" if self.windowed else ""
        reason = NOTHING_TO_DEFER + kept
        return Plan(self.mode, windowed=self.windowed, reason=reason, generation_bytes=self.generation_bytes)
