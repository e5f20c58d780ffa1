"""`Unit`: one gradient-reducing unit of a wrapped model.

The adapters find units (fsdp.py), the policies plan over them (policies.py) and the counters
count their collectives (accounting.py). The type lives on its own so that each of those
imports it from here rather than from one another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class Unit:
    """One gradient-reducing unit of a wrapped model."""

    name: str
    """Qualified module name ("" for the root)."""
    module: nn.Module
    numel: int
    """Trainable elements whose unsharded gradient this unit holds when its sync is deferred."""
    collectives: int
    """Collectives one sync of the unit issues (FSDP: reduce-scatters, one per param group)."""
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
    reshards_after_forward: bool = False
    """The unit frees its unsharded params after forward, so backward all-gathers them again
    (FSDP2 `reshard_after_forward`, FSDP1 FULL_SHARD; never the root, whose params backward
    needs at once)."""

    @property
    def param_bytes(self) -> int:
        """Bytes of this unit's unsharded parameters (what keeping them unsharded costs)."""
        return self.numel * self.compute_dtype.itemsize

    @property
    def held_bytes(self) -> int:
        """Bytes this unit holds per rank while its sync is deferred."""
        return self.numel * self.held_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes of the unsharded gradient one sync of this unit reduces."""
        return self.numel * self.reduce_dtype.itemsize
