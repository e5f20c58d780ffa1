"""`check_launch`: refuse, before the model is loaded, a launch the selected sync mode cannot run.

It reads only what `accelerate launch` (torch elastic underneath) exported for this process
(`launch_setup`), so a TRL script calls it right after parsing its arguments. A new check of the
launch goes here as one more `check_*` function called by `check_launch`; each raises a
ValueError naming the setting, its value and what to change. What the wrapped model itself can
run is checked again at `attach` (the same `planning.policies.check_wrapper`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from accel_gradsync.compat.cpu import fsdp_requested
from accel_gradsync.config.settings import GradSyncConfig, SyncMode
from accel_gradsync.planning.policies import check_wrapper


@dataclass(frozen=True)
class LaunchSetup:
    """What `accelerate launch` asked for, as this process sees it."""

    fsdp_version: int
    """1 or 2; 0: no FSDP config (DDP or a single process)."""
    replicate: int
    """The HSDP replicate size (parallelism_config dp_replicate_size); 1: no HSDP."""
    processes: int
    """The number of processes of the launch (WORLD_SIZE)."""


def launch_setup() -> LaunchSetup:
    """The launch as the environment `accelerate launch` exported describes it."""
    replicate = 1
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    return LaunchSetup(
        fsdp_version=int(os.environ.get("FSDP_VERSION", "1")) if fsdp_requested() else 0,
        replicate=replicate,
        processes=int(os.environ.get("WORLD_SIZE", "1")),
    )


def check_launch(config: GradSyncConfig | None = None) -> None:
    """Raise ValueError when this launch cannot run `config` (default: `GradSyncConfig()`, the
    settings of the environment): a sync mode the accelerate config's wrapper cannot run (FSDP
    version, HSDP replicate size), or `--max_restarts` with the launcher's shared rendezvous
    store. A single process has no sync to schedule, so any sync mode passes there.

    Call it after parsing and before loading the model. `check_restart` needs no config and is
    best called before `TrainingArguments` is built, which forms the process group a restart
    cannot form again."""
    config = GradSyncConfig() if config is None else config
    check_restart()
    check_sync_mode(config, launch_setup())


def check_sync_mode(config: GradSyncConfig, setup: LaunchSetup | None = None) -> None:
    """Refuse a sync mode the launch's wrapper cannot run, with the check `attach` makes of the
    wrapped model. keep_params_unsharded on FSDP1 is not refused: it does not apply there, and
    `attach` says so once."""
    setup = launch_setup() if setup is None else setup
    if setup.processes < 2:
        return  # one process: attach() warns that there is no sync to schedule
    settings = config.resolved()
    wrapper = f"fsdp{setup.fsdp_version}" if setup.fsdp_version else "ddp"
    try:
        check_wrapper(settings.sync_mode, wrapper, hsdp=setup.replicate > 1)
    except ValueError as error:
        selected = f"--grad-sync-mode {settings.sync_mode}" + (
            f" (or --grad-sync-memory-budget {config.memory_budget}, which selects it)"
            if settings.sync_mode == SyncMode.BUDGET
            else ""
        )
        raise ValueError(f"{selected}: {error}") from None


def check_restart() -> None:
    """Refuse `--max_restarts N` where the restarted group cannot form.

    With `--max_restarts`, torch elastic (2.13) restarts the workers of a failed launch; the new
    workers find each other through a TCPStore. When that store is the launcher's own (always for
    `--rdzv_backend static`, accelerate's default; by default for c10d), it is the same store
    across restarts and the process group's keys carry no attempt in their name, so a restarted
    rank can read a dead rank's address and fail with "Gloo connectFullMesh failed ... Connection
    refused" (NCCL: a stale unique id; PyTorch issue 135712). With `--rdzv_backend c10d` and
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` the workers' rank 0 starts a fresh store on a fresh
    port for every attempt. Only torch elastic exports the variables read here.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"accelerate launch --max_restarts {restarts}: a restarted group cannot form with the "
            "launcher's shared rendezvous store (its old keys point at the dead ranks). Launch with "
            "--rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's "
            "environment (docs/recipe.md, Restarts)."
        )
