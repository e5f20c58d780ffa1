"""Shared by the multi-rank workers: a small model, the real-collective counter (the benchmarks'
too, `testbed.collectives`; the launcher puts the repository root on PYTHONPATH), full gradients."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from testbed.collectives import CollectiveCounter  # noqa: F401 (the workers import it from here)

DIM = 16


class Block(nn.Module):
    """The unit the test accelerate configs wrap (`fsdp_transformer_layer_cls_to_wrap: Block`)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class TinyNet(nn.Module):
    """Two `Block` units plus a head owned by the root: three FSDP units, all trainable."""

    UNITS = 3

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def tiny_qwen2_config(**overrides):
    """A Qwen2 config small enough for a CPU test (2 decoder layers of hidden size 32), random
    weights; `overrides` changes any key (vocabulary, tied embeddings, special tokens)."""
    from transformers import Qwen2Config

    keys = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return Qwen2Config(**{**keys, **overrides})


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randn(n, generator=g)


def full_grads(model: nn.Module, sharded: dict[str, nn.Parameter] | None = None) -> dict[str, torch.Tensor]:
    """Unsharded gradients by original parameter name, for FSDP2, FSDP1 and DDP models. FSDP2:
    `sharded`, `dict(model.named_parameters())` taken while every unit was sharded (after
    `prepare`), reads the optimizer's own parameters where a unit is unsharded now (its
    `named_parameters` are then the unsharded ones)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    def clean(name: str) -> str:
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        return name.replace("module.", "", 1 if name.startswith("module.") else 0)

    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model, with_grads=True):
            return {clean(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if isinstance(model, FSDPModule):
        named = sharded if sharded is not None else dict(model.named_parameters())
        return {clean(n): p.grad.full_tensor().detach().clone() for n, p in named.items() if p.grad is not None}
    return {clean(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters by name, for FSDP2, FSDP1 and DDP models."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def parse_args(extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    for args, kwargs in extra or []:
        p.add_argument(*args, **kwargs)
    return p.parse_args()


def write_result(out: str, result: dict) -> None:
    """Write this rank's result, then leave the process group together. (The abort at exit,
    "terminate called without an active exception", is prevented by accel_gradsync.compat.teardown,
    which enable_cpu_fsdp() and attach() install.)"""
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train_lm_micro_batch(accelerator, model: nn.Module, optimizer, batch: torch.Tensor) -> float:
    """One causal-LM micro-batch inside `accelerator.accumulate(model)`: forward, backward and the
    optimizer's step and zero_grad (accelerate skips both until the window's last); its loss."""
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def sync_flags(model: nn.Module) -> dict[str, tuple[bool, bool, bool]]:
    """Every FSDP2 unit's (requires_gradient_sync, requires_all_reduce, reshard_after_backward),
    read where the package reads them (FSDP2 has setters but no getters)."""
    from torch.distributed.fsdp import FSDPModule

    from accel_gradsync.runtime.wrappers.fsdp2_state import sync_flags as unit_flags

    return {n: unit_flags(m) for n, m in model.named_modules() if isinstance(m, FSDPModule)}
