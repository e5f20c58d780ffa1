"""Launch a worker script the way users do (`accelerate launch`) and collect what each rank wrote.

Every worker gets `--out DIR` and writes `DIR/rank<R>.json`; `launch` returns those dicts in
rank order, or raises with the tail of the output when the run fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_distributed(
    script: Path | str,
    args: list[str],
    config: dict | None = None,
    nprocs: int = 2,
    env: dict | None = None,
    timeout: int = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file <config> script args`, or, with no config, `torchrun`
    with `ACCELERATE_USE_CPU=true` (accelerate launches CPU DDP only through mpirun)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        port = str(free_port())
        if config is None:
            full_env["ACCELERATE_USE_CPU"] = "true"
            launcher = ["torch.distributed.run", f"--nproc_per_node={nprocs}", f"--master_port={port}"]
        else:
            config_file = Path(tmp) / "accelerate.yaml"
            config_file.write_text(yaml.safe_dump(config))
            launcher = ["accelerate.commands.launch", "--config_file", str(config_file), "--main_process_port", port]
        cmd = [sys.executable, "-m", *launcher, str(script), *args]
        return subprocess.run(cmd, env=full_env, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


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
    with tempfile.TemporaryDirectory() as out:
        proc = run_distributed(WORKERS / f"{worker}.py", ["--out", out, *args], config, nprocs, env, timeout)
        results = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(results) != nprocs:
            raise AssertionError(
                f"{worker} {' '.join(args)} failed (exit {proc.returncode}):\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )
        return [json.loads(p.read_text()) for p in results]
