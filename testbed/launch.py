"""Launch a script on several ranks as users do, `accelerate launch --config_file` (or `torchrun` for
CPU DDP), and collect the `rank<R>.json` each rank writes to its `--out DIR`. The benchmarks and the
multi-rank tests (tests/distributed/launcher.py) share it; with a `cluster.Cluster` the launch runs
once per simulated host, as a multi-node job does.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from testbed.cluster import Cluster, run_all

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Launched:
    returncode: int  # the first non-zero exit code over hosts, else 0
    output: str  # stdout and stderr, interleaved (the last lines only on a cluster)
    ranks: list[dict] = field(default_factory=list)  # each rank's JSON, in rank order

    def check(self, what: str, nranks: int) -> list[dict]:
        """The ranks' JSON; RuntimeError with the output's tail unless all `nranks` wrote theirs and exited 0."""
        if self.returncode != 0 or len(self.ranks) != nranks:
            raise RuntimeError(f"{what} failed (exit {self.returncode}):\n{self.output[-8000:]}")
        return self.ranks


def fsdp2_config(layer_class: str, nranks: int) -> dict:
    """An accelerate config as a user would write it: FSDP2 wrapping each `layer_class`, no mixed
    precision; 4 ranks are a 2x2 HSDP mesh (replicate x shard). On CPU the worker's
    `enable_cpu_fsdp()` makes it FSDP over gloo; elsewhere accelerate picks NCCL/HCCL."""
    fsdp = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": layer_class,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    config = {"distributed_type": "FSDP", "num_processes": nranks, "fsdp_config": fsdp, "mixed_precision": "no"}
    if nranks == 4:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 2,
        }
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, offline, one OMP thread per rank (ranks share the cores), this repository
    first on PYTHONPATH, and no sync mode inherited from ACCEL_GRADSYNC_DEFER: `env` alone sets it."""
    full = {k: v for k, v in os.environ.items() if k != "ACCEL_GRADSYNC_DEFER"}
    full.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    return full


def launch(
    script: Path | str,
    args: list[str],
    config: dict | None = None,
    *,
    nprocs: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    hosts: Cluster | None = None,
    echo: Callable[[int, str], None] | None = None,
) -> Launched:
    """`script --out DIR *args` under `accelerate launch` with `config` (None: torchrun with `nprocs`
    CPU ranks), from the repository root, once per host of `hosts` (multi-node flags for either
    launcher); `echo(host, line)` sees every output line as it comes."""
    full_env = environment(env)
    with tempfile.TemporaryDirectory() as out:
        worker = [str(script), "--out", out, *args]
        if config is None:
            full_env["ACCELERATE_USE_CPU"] = "true"
            launcher = ["torch.distributed.run"]
            if hosts is None:
                launcher += [f"--nproc_per_node={nprocs}", f"--master_port={free_port()}"]
        else:
            config_file = Path(out, "accelerate.yaml")
            if hosts is not None:
                config = {**config, "num_machines": hosts.hosts}
            config_file.write_text(yaml.safe_dump(config))
            launcher = ["accelerate.commands.launch", "--config_file", str(config_file)]
        command = [sys.executable, "-m", *launcher]
        if hosts is not None:
            flags_of = hosts.accelerate_flags if config else functools.partial(hosts.torchrun_flags, nprocs=nprocs)
            per_host = [flags_of(h) for h in range(hosts.hosts)]
            done = hosts.run(
                [[*command, *flags, *worker] for flags in per_host], full_env, cwd=REPO, timeout=timeout, echo=echo
            )
            code = next((c for c, _ in done if c != 0), 0)
            output = "".join(f"--- host {h} ---\n" + "".join(tail) for h, (_, tail) in enumerate(done))
        else:
            if config is not None:
                command += ["--main_process_port", str(free_port())]
            pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "start_new_session": True}
            start = functools.partial(subprocess.Popen, [*command, *worker], env=full_env, cwd=REPO, **pipe)
            ((code, tail),) = run_all([start], timeout, echo, keep=5000)
            output = "".join(tail)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return Launched(code, output, ranks)
