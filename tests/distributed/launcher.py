"""The multi-rank tests' launches, on the benchmarks' launcher (`benchmarks/launch.py`): a worker
of `workers/` gets `--out DIR` and writes `DIR/rank<R>.json`; `launch` returns those dicts in
rank order, or raises with the tail of the output when the run fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.launch import REPO, free_port
from benchmarks.launch import launch as launch_ranks

WORKERS = Path(__file__).parent / "workers"


def accelerate_config(kind: str, num_processes: int = 2, **fsdp: object) -> dict:
    """A minimal accelerate config for `fsdp1` or `fsdp2`, wrapping the workers' `Block`."""
    assert kind in ("fsdp1", "fsdp2"), kind
    fsdp_config = {
        "fsdp_version": int(kind[-1]),
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block",
        **fsdp,
    }
    return {"distributed_type": "FSDP", "num_processes": num_processes, "fsdp_config": fsdp_config}


def recipe_launch(argv: list[str], env: dict | None = None) -> tuple[list[str], dict]:
    """The command and environment that run `accelerate launch <argv>` from the repo root as a
    module of this interpreter, on a free port, offline, with the mode set by `argv` alone."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [full_env.get("PYTHONPATH"), str(REPO)]))
    full_env.pop("ACCEL_GRADSYNC_DEFER", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *argv]
    return cmd, full_env


def launch(
    worker: str,
    args: list[str],
    config: dict | None = None,
    env: dict | None = None,
    timeout: int = 600,
    nprocs: int = 2,
) -> list[dict]:
    """Run `workers/<worker>.py` on `nprocs` ranks (accelerate launch with the config's
    processes, or torchrun without a config); return each rank's JSON result."""
    nprocs = config["num_processes"] if config else nprocs
    done = launch_ranks(WORKERS / f"{worker}.py", args, config, nprocs=nprocs, env=env, timeout=timeout)
    if done.returncode != 0 or len(done.ranks) != nprocs:
        raise AssertionError(f"{worker} {' '.join(args)} failed (exit {done.returncode}):\n{done.output[-12000:]}")
    return done.ranks
