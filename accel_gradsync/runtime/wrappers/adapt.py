"""Which adapter reads a prepared model (`adapt_model`), and what the refusals and the Trainer's
hooks ask of the wrapping (`is_fsdp_wrapped`, `sharded_by_transformers`), and the name messages give
a model under its wrappers (`model_name`)."""

from __future__ import annotations

from typing import Any

from accelerate.utils import is_compiled_module
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel

from accel_gradsync.runtime.wrappers.adapter import ModelAdapter
from accel_gradsync.runtime.wrappers.ddp import DDPAdapter
from accel_gradsync.runtime.wrappers.fsdp1 import FSDP1Adapter
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter


def adapt_model(model: nn.Module, torch_release: str | None = None) -> ModelAdapter | None:
    """The adapter for a prepared model, or None when it is not wrapped for data parallelism. A
    module around an FSDP2 root (PEFT's `PeftModel` around a model transformers sharded at load
    time) is adapted by that root, with its trainable parameters outside the units.
    `torch_release`: the torch series whose dtype rules FSDP2 units follow (the estimate's
    `--torch`; None: the running torch's)."""
    if isinstance(model, FSDPModule):
        return FSDP2Adapter(model, torch_release)
    if isinstance(model, FSDP1):
        return FSDP1Adapter(model)
    if isinstance(model, DistributedDataParallel):
        return DDPAdapter(model)
    root = fsdp2_root_inside(model)
    if root is None:
        return None
    from torch.distributed.tensor import DTensor

    adapter = FSDP2Adapter(root, torch_release)
    adapter.replicated = [p for p in root.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    return adapter


def fsdp2_root_inside(model: nn.Module) -> nn.Module | None:
    """The FSDP2 root inside a module that is not one itself: its outermost `FSDPModule`, when
    every other one is inside it; None where there is none (or several side by side)."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    root = sharded[0]  # modules() walks parents before children
    inside = set(root.modules())
    return root if all(m in inside for m in sharded) else None


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """True when the model or any submodule is sharded by FSDP1 or FSDP2."""
    return any(isinstance(m, (FSDPModule, FSDP1)) for m in model.modules())


def sharded_by_transformers(trainer: Any) -> bool:
    """True when `trainer`'s model was sharded at load time by transformers (`DistributedConfig`)."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def model_name(root: nn.Module) -> str:
    """The user's class name of a wrapped model (not FSDP1's wrapper, FSDP2's `FSDP<cls>` or
    torch.compile's `OptimizedModule`, which accelerate's dynamo_backend puts inside FSDP2 and
    around FSDP1 and DDP)."""
    model: nn.Module = root
    while isinstance(model, (FSDP1, DistributedDataParallel)) or is_compiled_module(model):
        inner = model._orig_mod if is_compiled_module(model) else model.module
        assert isinstance(inner, nn.Module)  # what each wrapper wraps
        model = inner
    return next(c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))
