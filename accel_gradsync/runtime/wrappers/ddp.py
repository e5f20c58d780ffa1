"""`DDPAdapter`: a `DistributedDataParallel` model is one unit; its sync is deferred through the
root's `no_sync()` (`root_only`), which accelerate calls."""

from __future__ import annotations

import torch
from torch import nn

from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


class DDPAdapter(ModelAdapter):
    """`DistributedDataParallel`: the whole model is one unit, all-reduced in buckets whose
    count DDP decides at the first backward; `no_sync()` skips all of them."""

    kind = "ddp"
    collective = "all_reduce"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        params = [p for p in model.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        numel = sum(p.numel() for p in params)
        return [Unit("", model, numel, 1, dtype, dtype, dtype, shard_size=1, sharded_numel=numel)]

    def held_grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)
