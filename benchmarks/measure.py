"""What the workers share besides the collectives (`collectives.py`): their command line and rank
file (`worker_args`, `write_rank`), pinning and versions, and what they measure: an optimizer step's
time, the gradient and unsharded parameter bytes held after each backward, read from FSDP2's tensors
(`StepMeter`; `step_callback` for a Trainer), memory peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

import accel_gradsync
from accel_gradsync.planning.memory import peak_rss_bytes, reset_peak_rss


def worker_args(**flags: Any) -> argparse.Namespace:
    """A worker's command line as the harness writes it: `--out DIR`, `--pin-cores` and `--a-b` for
    each keyword `a_b`, of its default's type (a bool: a switch; None: a string)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pin-cores", action="store_true")
    for name, default in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=str if default is None else type(default), default=default)
    return p.parse_args()


def write_rank(out: str, rank: int, record: Any) -> None:
    """This rank's record (a dataclass or a dict) as `rank<R>.json` in `out`, where `launch` reads it."""
    data = dataclasses.asdict(record) if dataclasses.is_dataclass(record) else record
    Path(out, f"rank{rank}.json").write_text(json.dumps(data, indent=1))


def attach(target, kwargs: dict | None):
    """`accel_gradsync.attach` with these GradSyncConfig arguments (None: no plugin), its one-line
    decision kept out of the progress output; the handle."""
    if kwargs is None:
        return None
    with contextlib.redirect_stdout(io.StringIO()):
        return accel_gradsync.attach(target, accel_gradsync.GradSyncConfig(**kwargs))


def scalar_stats(handle) -> dict[str, Any]:
    """The handle's `stats()` that a rank's record keeps, its scalars ({} without the plugin)."""
    stats = handle.stats() if handle is not None else {}
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}


def pin_to_core() -> int:
    """Pin this rank to one core (local rank mod count), as each rank owns its device on a GPU node:
    unpinned, every collective waits on whichever rank the scheduler last moved."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def versions(*extra: str) -> dict[str, str]:
    """Versions of torch, accelerate, transformers, accel_gradsync and `extra` packages, and the backend."""
    out = {name: importlib.import_module(name).__version__ for name in ("torch", "accelerate", "transformers", *extra)}
    return {**out, "accel_gradsync": accel_gradsync.__version__, "backend": dist.get_backend()}


def fsdp2_groups(model: nn.Module) -> list:
    """Every FSDP2 param group (a unit) of the model, once (torch 2.13's private state)."""
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    return list({id(g): g for g in groups}.values())


def nbytes(t: torch.Tensor | None) -> int:
    """The bytes of a tensor as stored on this rank (a DTensor: its local shard; None: 0)."""
    t = getattr(t, "_local_tensor", t)
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(gradient, unsharded parameter) bytes this rank holds now. Gradients: sharded plus every
    unsharded (deferred) one FSDP2 keeps between micro-batches, from its `FSDPParam` fields (no public
    getter); not FSDP2: every .grad. Params: those whose unsharded storage is allocated."""
    params = list({id(fp): fp for g in fsdp2_groups(model) for fp in g.fsdp_params}.values())
    if not params:
        return sum(nbytes(p.grad) for p in model.parameters()), 0
    grads = params_held = 0
    for fp in params:
        unsharded = getattr(fp, "_unsharded_param", None)
        grads += nbytes(getattr(fp, "unsharded_accumulated_grad", None)) + nbytes(fp.sharded_param.grad)
        if unsharded is not None:
            grads += nbytes(unsharded.grad)
            params_held += unsharded.numel() * unsharded.element_size() if unsharded.untyped_storage().size() else 0
    return grads, params_held


class StepMeter:
    """One optimizer step: `start()`, `probe(model)` after every backward, `stop()` -> the
    `records.Measured` fields; `device_peak` is then the CUDA/NPU allocator's peak (None on CPU)."""

    def __init__(self, device: str = "cpu") -> None:
        self.backend = getattr(torch, device) if device in ("cuda", "npu") else None
        self.probes: list[tuple[int, int]] = []
        self.probing = False

    def start(self) -> None:
        reset_peak_rss()
        if self.backend is not None:
            self.backend.reset_peak_memory_stats()
        self.rss_before = psutil.Process().memory_info().rss
        self.probes, self.probing = [], True
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def probe(self, model: nn.Module) -> None:
        if self.probing:
            self.probes.append(held_bytes(model))

    def stop(self) -> dict:
        if self.backend is not None:
            self.backend.synchronize()
        elapsed, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        self.probing = False
        self.device_peak = None if self.backend is None else int(self.backend.max_memory_allocated())
        return dict(
            time_s=elapsed,
            cpu_s=cpu,
            held_grad_bytes=max((g for g, _ in self.probes), default=0),
            held_param_bytes=max((p for _, p in self.probes), default=0),
            rss_growth_bytes=max(peak_rss_bytes() - self.rss_before, 0),
        )


def step_callback(meter: StepMeter, before: Callable[[], None], done: Callable[[object, dict], None]):
    """A Trainer callback metering every optimizer step, from `on_step_begin` (after `before()`) to
    `on_step_end` (`done(state, measured)`), probing `.trainer`'s model after every micro-batch."""
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
