"""The recipe's checks of its settings, run before the model is loaded or anything is written.

Each refusal is a `ValueError` whose message names the setting, the value and what to do;
`exit_on_setting_error` prints it as one line from the main process. What is checked here is
what would otherwise fail late (inside `train()`, after output_dir exists and the model is
loaded) or, worse, half-way through a long run: a batch size of 0, a sync mode the accelerate
config cannot run, and a restart the launcher cannot carry out.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import NoReturn

from accel_gradsync.compat.cpu import fsdp_requested
from accel_gradsync.config.settings import SyncMode
from accel_gradsync.planning.policies import check_wrapper

HELP = "python recipes/grpo.py --help"

# How long a rank other than the main process waits, after a setting error, for the launcher to stop
# it: every rank checks the same settings, so the main process reports the same error and the
# launcher stops the others when it exits. A rank that fails alone (a path missing on its node
# only) reports its error itself after this wait.
_PEER_WAIT_S = 30.0


class ParseError(ValueError):
    """A command line or YAML that does not parse; reported with a pointer to --help."""


def is_main_process() -> bool:
    """Rank 0 of the launch, or a process that was not launched as one of several."""
    return os.environ.get("RANK", "0") == "0"


def warn_once(message: str) -> None:
    """One warning for the whole launch (the main process's), not one per rank."""
    if is_main_process():
        warnings.warn(message, UserWarning, stacklevel=3)


def exit_on_setting_error(error: ValueError) -> NoReturn:
    """Print `error` as one line from the main process (with a pointer to --help for a parse
    error) and exit 2; the other ranks say nothing unless the launcher leaves them running."""
    message = " ".join(str(error).split())  # one line, whatever the message was built from
    lines = [f"error: {message}"] + ([f"See `{HELP}` for every setting."] if isinstance(error, ParseError) else [])
    if not is_main_process():
        time.sleep(_PEER_WAIT_S)  # normally ends by the launcher's SIGTERM, see _PEER_WAIT_S
        lines = [f"[rank {os.environ.get('RANK')}] {line}" for line in lines]
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(2)


_COUNTS = {
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "per_device_train_batch_size": "completions per device per micro-batch",
}


def check_training_settings(training_args) -> None:
    """Counts that must be positive (`--max_steps` -1 means "by epochs"), and a save interval that
    must not be silently unused."""
    for name in _COUNTS:
        value = getattr(training_args, name)
        if value < 1:
            raise ValueError(f"--{name} {value}: must be >= 1 ({_COUNTS[name]}).")
    if training_args.max_steps == 0:  # transformers reads 0 as a step count and still trains and saves
        raise ValueError(
            "--max_steps 0: must be >= 1 (optimizer steps), or -1 to train for --num_train_epochs "
            f"({training_args.num_train_epochs:g})."
        )
    strategy = str(getattr(training_args.save_strategy, "value", training_args.save_strategy))
    if strategy == "steps" and training_args.save_steps <= 0:
        raise ValueError(
            f"--save_steps {training_args.save_steps:g}: must be > 0 with --save_strategy steps "
            "(or set --save_strategy no to save only at the end)."
        )


def check_save_steps_used(training_args, default_save_steps: float) -> None:
    """A --save_steps that the save strategy does not read gets one warning."""
    strategy = str(getattr(training_args.save_strategy, "value", training_args.save_strategy))
    if strategy != "steps" and training_args.save_steps != default_save_steps:
        warn_once(
            f"--save_steps {training_args.save_steps:g} is ignored with --save_strategy {strategy}; "
            "set --save_strategy steps to save every N steps."
        )


def launch_setup() -> dict:
    """What `accelerate launch` exported for this process: the FSDP version (0: no FSDP), the
    HSDP replicate size and the number of processes."""
    fsdp = fsdp_requested()
    replicate = 1
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    return {
        "fsdp_version": int(os.environ.get("FSDP_VERSION", "1")) if fsdp else 0,
        "replicate": replicate,
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
    }


def check_sync_mode_fits_launch(grad_sync_args) -> None:
    """Refuse a grad sync mode the accelerate config cannot run, with the plugin's own check
    (`policies.check_wrapper`), before the model is loaded rather than at `attach`.
    keep_params_unsharded on FSDP1 is not refused: it does not apply there, and the plugin says
    so once."""
    setup = launch_setup()
    if setup["processes"] < 2:
        return  # one process: attach() warns that there is no sync to schedule
    mode = grad_sync_args.mode
    wrapper = f"fsdp{setup['fsdp_version']}" if setup["fsdp_version"] else "ddp"
    try:
        check_wrapper(mode, wrapper, hsdp=setup["replicate"] > 1)
    except ValueError as error:
        selected = f"--grad-sync-mode {mode}" + (
            f" (or --grad-sync-memory-budget {grad_sync_args.memory_budget}, which selects it)"
            if mode == SyncMode.BUDGET
            else ""
        )
        raise ValueError(f"{selected}: {error}") from None


def check_restart_settings() -> None:
    """Refuse `--max_restarts N` where the restarted group cannot form.

    With `--max_restarts`, torch elastic (2.13) restarts the workers of a failed launch; the new
    workers find each other through a TCPStore. When that store is the launcher's own (always for
    `--rdzv_backend static`, accelerate's default; by default for c10d), it is the same store
    across restarts and the process group's keys carry no attempt in their name, so a restarted
    rank can read a dead rank's address and fail with "Gloo connectFullMesh failed ... Connection
    refused" (NCCL: a stale unique id; PyTorch issue 135712). With `--rdzv_backend c10d` and
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` the workers' rank 0 starts a fresh store on a fresh
    port for every attempt.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"accelerate launch --max_restarts {restarts}: a restarted group cannot form with the "
            "launcher's shared rendezvous store (its old keys point at the dead ranks). Launch with "
            "--rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's "
            "environment (README, GRPO recipe: restarting)."
        )
