"""The multi-rank tests' launches, on the launcher the benchmarks use too (`testbed/launch.py`): a worker
of `workers/` gets `--out DIR` and writes `DIR/rank<R>.json`; `launch` returns those dicts in
rank order, or raises with the tail of the output when the run fails.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from testbed.launch import REPO, free_port
from testbed.launch import launch as launch_ranks

WORKERS = Path(__file__).parent / "workers"
COUNTER = Path(__file__).parent / "recipe_counter"


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


def launch_counted(command: str, tmp: Path) -> dict:
    """`command` (`accelerate launch ...`, as a doc gives it) from the repo root on 2 ranks,
    offline, the collectives counted from outside (recipe_counter/sitecustomize.py): the output
    and each rank's counts, or an AssertionError with the output's tail where it failed."""
    argv = shlex.split(command)
    assert argv[:2] == ["accelerate", "launch"], command
    counters = tmp / "counters"
    counters.mkdir()
    env = {
        "RECIPE_COUNTER_DIR": str(counters),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")])),
    }
    cmd, env = recipe_launch(argv[2:], env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command} failed ({proc.returncode}):\n{output[-8000:]}"
    ranks = [json.loads(p.read_text()) for p in sorted(counters.glob("rank*.json"))]
    assert len(ranks) == 2, output[-4000:]
    return {"stdout": proc.stdout, "output": output, "ranks": ranks}


def reduce_scatters(rank: dict) -> int:
    """A `launch_counted` rank's reduce-scatters, by either of torch's names."""
    return rank["counts"].get("reduce_scatter_single", 0) + rank["counts"].get("reduce_scatter_tensor", 0)


def all_gathers(rank: dict) -> int:
    """A `launch_counted` rank's all-gathers into a tensor (FSDP's), by either of torch's names."""
    return rank["counts"].get("all_gather_single", 0) + rank["counts"].get("all_gather_into_tensor", 0)


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
