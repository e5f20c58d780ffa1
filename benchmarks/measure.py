"""What both workers measure from the real tensors and the process, besides the collectives
(`collectives.py`): one optimizer step's time, the gradient and unsharded parameter bytes held
after each backward (`StepMeter`; `step_callback` for a Trainer), memory peaks, pinning, versions.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist
from torch import nn

import accel_gradsync
from accel_gradsync.planning.memory import peak_rss_bytes, reset_peak_rss


def pin_to_core() -> int:
    """Pin this rank to one core of those it may use (local rank mod count), as each rank owns its
    device on a GPU node. Unpinned, the ranks' main, autograd and gloo threads migrate between the
    cores and every collective waits on whichever rank the scheduler last moved."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def versions(*extra: str) -> dict[str, str]:
    """Versions of torch, accelerate, transformers, accel_gradsync and `extra` packages, and the backend."""
    out = {name: importlib.import_module(name).__version__ for name in ("torch", "accelerate", "transformers", *extra)}
    return {**out, "accel_gradsync": accel_gradsync.__version__, "backend": dist.get_backend()}


def fsdp2_groups(model: nn.Module) -> list:
    """Every FSDP2 param group of the model (a unit), once (torch 2.13's private state)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    return list({id(g): g for g in groups}.values())


def fsdp2_params(model: nn.Module) -> list:
    return list({id(fp): fp for g in fsdp2_groups(model) for fp in g.fsdp_params}.values())


def _local_nbytes(t: torch.Tensor | None) -> int:
    t = getattr(t, "_local_tensor", t)
    return 0 if t is None else t.numel() * t.element_size()


def held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds right now: sharded gradients plus every unsharded (deferred)
    gradient FSDP2 keeps between micro-batches, read from its `FSDPParam` fields (no public getter)."""
    params = fsdp2_params(model)
    if not params:  # not FSDP2 (DDP, plain): every .grad is whole
        return sum(_local_nbytes(p.grad) for p in model.parameters())
    total = 0
    for fp in params:
        unsharded = getattr(fp, "_unsharded_param", None)
        total += _local_nbytes(getattr(fp, "unsharded_accumulated_grad", None)) + _local_nbytes(fp.sharded_param.grad)
        total += 0 if unsharded is None else _local_nbytes(unsharded.grad)
    return total


def held_param_bytes(model: nn.Module) -> int:
    """Unsharded parameter bytes allocated right now (FSDP2 frees them by resizing the storage to 0)."""
    total = 0
    for fp in fsdp2_params(model):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.untyped_storage().size() > 0:
            total += unsharded.numel() * unsharded.element_size()
    return total


def _backend(device: str):
    return getattr(torch, device, None) if device in ("cuda", "npu") else None


class StepMeter:
    """One optimizer step: `start()`, `probe(model)` after every backward, `stop()` -> the
    `records.Measured` fields; `scoped`, `peak` and `device_peak` are then the step's memory peaks."""

    def __init__(self, device: str = "cpu") -> None:
        self.device, self.probes, self.probing = device, [], False

    def start(self) -> None:
        self.scoped = reset_peak_rss()
        if (backend := _backend(self.device)) is not None:
            backend.reset_peak_memory_stats()
        self.rss_before = psutil.Process().memory_info().rss
        self.probes, self.probing = [], True
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def probe(self, model: nn.Module) -> None:
        if self.probing:
            self.probes.append((held_grad_bytes(model), held_param_bytes(model)))

    def stop(self) -> dict:
        if (backend := _backend(self.device)) is not None:
            backend.synchronize()
        elapsed, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        self.probing, self.peak = False, peak_rss_bytes()
        backend = _backend(self.device)
        self.device_peak = None if backend is None else int(backend.max_memory_allocated())
        return dict(time_s=elapsed, cpu_s=cpu, held_grad_bytes=max((g for g, _ in self.probes), default=0),
                    held_param_bytes=max((p for _, p in self.probes), default=0),
                    rss_growth_bytes=max(self.peak - self.rss_before, 0))  # fmt: skip


def step_callback(meter: StepMeter, before: Callable[[], None], done: Callable[[object, dict], None]):
    """A Trainer callback metering every optimizer step, from `on_step_begin` (after `before()`) to
    `on_step_end` (`done(state, measured)`), probing `.trainer`'s model after every micro-batch.
    transformers is imported here: the MLP worker needs it only for its Trainer peer."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            before()
            meter.start()

        def on_substep_end(self, args, state, control, **kwargs):
            meter.probe(self.trainer.model_wrapped)

        on_pre_optimizer_step = on_substep_end

        def on_step_end(self, args, state, control, **kwargs):
            done(state, meter.stop())

    return Steps()
