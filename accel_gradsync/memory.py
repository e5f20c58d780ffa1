"""Free device memory per rank, agreed across ranks: the input of the `auto` and fractional
`budget` decisions. Runs once per model, before the first step, never in the micro-batch loop."""

from __future__ import annotations

import psutil
import torch
import torch.distributed as dist

from .config import GradSyncConfig


def free_device_memory(device: torch.device) -> int:
    """Free bytes on `device`: CUDA / Ascend NPU `mem_get_info`, on CPU the available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]  # torch_npu
    return psutil.virtual_memory().available


def agreed_free_memory(config: GradSyncConfig, device: torch.device) -> int:
    """This rank's free memory (or `config.free_memory`), then the minimum over all ranks, so
    every rank takes the same decision even when their free memory differs."""
    free = config.free_memory_bytes
    if free is None:
        free = free_device_memory(device)
    if dist.is_available() and dist.is_initialized():
        value = torch.tensor([free], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        free = int(value.item())
    return free
