"""Real FSDP1/FSDP2 over gloo under `accelerate launch` on a machine with no GPU or NPU.

accelerate (1.15) gives such a launch `DistributedType.NO` (or DDP with `ACCELERATE_USE_CPU`), asks
for a GPU-like device in `sync_module_states`, and gives FSDP1 a `cpu:0` device it rejects.
`enable_cpu_fsdp` exports what is missing and turns the shared state into FSDP with the launcher's
plugin, as accelerate does for `MULTI_GPU`; the state is checked afterwards, so an accelerate
release that changes these internals fails here, loudly, instead of training unsharded.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from accelerate import ParallelismConfig
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

from accel_gradsync.compat.teardown import install_exit_guard

# The environment `accelerate launch` would export for a CPU FSDP run, if it supported one.
_CPU_FSDP_ENV = {
    "ACCELERATE_USE_CPU": "true",
    "ACCELERATE_TORCH_DEVICE": "cpu",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
}


def fsdp_requested() -> bool:
    """True when `accelerate launch` was given an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def has_accelerator_device() -> bool:
    """True when accelerate would find a GPU-like device and needs no help."""
    npu = getattr(torch, "npu", None)
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or bool(npu is not None and npu.is_available())
        or bool(xpu is not None and xpu.is_available())
    )


def enable_cpu_fsdp() -> bool:
    """Make an FSDP `accelerate launch` give real FSDP over gloo on a CPU-only machine.

    Call it before the `Accelerator` or `Trainer` is built (for a `Trainer`, also pass
    `accelerator_config={"use_configured_state": True}` to its arguments). Returns True when
    it enabled CPU FSDP, False when there was nothing to do: no FSDP config, a GPU/NPU present
    (accelerate handles those itself) or a single process.
    """
    if not fsdp_requested() or has_accelerator_device():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if PartialState._shared_state:
        state = AcceleratorState() if AcceleratorState._shared_state else PartialState()
        if state.distributed_type == DistributedType.FSDP:
            return True
        raise RuntimeError(
            "accel_gradsync.enable_cpu_fsdp() must run before the Accelerator, Trainer or "
            "TrainingArguments is built, but accelerate's state already exists with "
            f"distributed_type={state.distributed_type}. Move the call to the top of your script."
        )

    # `accelerate launch` exports both as true unless the config says otherwise, so this is a note
    # about accelerate's defaults, not a warning about the user's settings: one line, rank 0.
    asked = {k: os.environ.get(k) for k in ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING")}
    if any((v or "").lower() == "true" for v in asked.values()) and os.environ.get("RANK", "0") == "0":
        print(
            "accel_gradsync: FSDP on CPU over gloo: accelerate's fsdp_sync_module_states and "
            "fsdp_cpu_ram_efficient_loading need a GPU/NPU and are off; every rank builds identical weights "
            "(same seed or the same checkpoint).",
            file=sys.stderr,
        )
    os.environ.update(_CPU_FSDP_ENV)

    # The shared state an `Accelerator(cpu=True)` would build: MULTI_CPU over gloo (1, 4). Built
    # directly because an Accelerator would also validate a parallelism config (HSDP) against
    # MULTI_CPU and refuse it; `_from_accelerator` is how accelerate itself builds it.
    plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP config, from the environment
    parallelism = None  # HSDP and friends, from the launcher's environment, as Accelerator reads it
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        parallelism = ParallelismConfig()
    state = AcceleratorState(
        cpu=True, dynamo_plugin=TorchDynamoPlugin(), parallelism_config=parallelism, _from_accelerator=True
    )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin  # (2) what accelerate does for MULTI_GPU
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    check_fsdp_state()
    install_exit_guard()  # gloo's workers must be done before the interpreter exits (teardown.py)
    return True


def training_args_defaults() -> dict[str, Any]:
    """The `TrainingArguments` (`GRPOConfig`, `SFTConfig`, ...) defaults this launch needs, for
    `parser.set_defaults(**training_args_defaults())` before parsing, or `GRPOConfig(**...)`.

    Nothing on a machine with a GPU/NPU. On one without: `bf16=False` (TRL's configs default to
    bf16, which transformers refuses there: "Your setup doesn't support bf16/gpu") and
    `dataloader_pin_memory=False` (pinning needs a device; the DataLoader warns); where
    `enable_cpu_fsdp()` made this launch FSDP, also `accelerator_config={"use_configured_state":
    True}`, so the Trainer keeps that FSDP state instead of building a non-FSDP one. A flag or
    YAML key given explicitly still wins over these defaults.

    Raises RuntimeError when an FSDP launch of several processes on a machine with no GPU/NPU has
    not called `enable_cpu_fsdp()` yet: the Trainer would otherwise train without FSDP.
    """
    if has_accelerator_device():
        return {}
    defaults: dict[str, Any] = {"bf16": False, "dataloader_pin_memory": False}
    if fsdp_requested() and int(os.environ.get("WORLD_SIZE", "1")) >= 2:
        if not _cpu_fsdp_enabled():
            raise RuntimeError(
                "accel_gradsync.training_args_defaults(): this launch asks for FSDP "
                f"(ACCELERATE_USE_FSDP=true, WORLD_SIZE={os.environ['WORLD_SIZE']}) on a machine with no "
                "GPU/NPU, but accel_gradsync.enable_cpu_fsdp() has not run: call it first, before parsing "
                "the arguments, so that the Trainer keeps its FSDP state."
            )
        defaults["accelerator_config"] = {"use_configured_state": True}
    return defaults


def _cpu_fsdp_enabled() -> bool:
    """True when accelerate's shared state is FSDP (on a machine without GPU/NPU, only
    `enable_cpu_fsdp()` makes it so)."""
    return bool(PartialState._shared_state) and PartialState().distributed_type == DistributedType.FSDP


def check_fsdp_state() -> None:
    """Raise unless accelerate reports FSDP with a plugin, over an initialised process group."""
    state = AcceleratorState()
    if (
        state.distributed_type != DistributedType.FSDP
        or getattr(state, "fsdp_plugin", None) is None
        or not torch.distributed.is_initialized()
    ):
        raise RuntimeError(
            "accel_gradsync.enable_cpu_fsdp() could not switch accelerate to FSDP on CPU: accelerate "
            f"reports distributed_type={state.distributed_type}. This accelerate release changed the "
            "internals the workaround relies on (accel_gradsync/compat/cpu.py); pin the accelerate version "
            "from constraints.txt or run on a GPU/NPU."
        )
