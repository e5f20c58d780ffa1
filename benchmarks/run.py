"""The benchmark harness: `python -m benchmarks.run [--quick] [--grpo] [--device cpu|cuda|npu] [--out DIR]`.

The MLP (`mlp.py`, the default) and GRPO (`--grpo`, `grpo.py`) benchmarks are configurations of it:
a plan, the networks and the launches. Each launch runs under `accelerate launch` (`launch.py`) over
loopback, or with `--cluster HxR --link ...` once per link on simulated hosts (`cluster.py`); the
ranks' records become a run each in results.json (GRPO: one run per network, merged from its FSDP2
and DDP launches, which alternate round by round: `grpo.py`), and the benchmark's report
writes results.md, the PNGs and the PASS/FAIL summary (`--redraw DIR`: again from DIR/results.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

from benchmarks import grpo, grpo_report, mlp, mlp_report
from benchmarks.records import GrpoResults, Results, RunBase
from testbed import cluster
from testbed.launch import REPO, fsdp2_config, launch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--quick", action="store_true", help="small model, M=1,2,4, few configs (CI smoke test)")
    add("--grpo", action="store_true", help="the GRPO benchmark (grpo.py): TRL's GRPOTrainer, stock and every mode")
    add("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    add("--out", default=str(REPO / "benchmarks" / "results"))
    add("--sizes", help="comma-separated, from mlp.SIZES")
    add("--Ms", help="comma-separated micro-batch counts")
    add("--configs", help="comma-separated, from mlp.CONFIGS (with --grpo: grpo.CONFIGS)")
    add("--beta", type=float, default=0.0, help="with --grpo: GRPO's KL coefficient (> 0: a reference model)")
    add("--reps", type=int, help="repetitions of every configuration, interleaved (GRPO: rounds, FSDP2 then DDP)")
    add("--steps", type=int, help="timed steps per repetition and M (GRPO: steps per round, the first untimed)")
    add("--profile", action="store_true", help="with --grpo: cProfile rank 0's timed steps (profile_diff compares two)")
    add("--no-pin", action="store_true", help="CPU: leave the ranks unpinned (default: one core per rank)")
    add("--hsdp-size", help=f"model size of the 4-rank HSDP launch (default: {mlp.HSDP_SIZE}; quick cluster: small)")
    add("--timeout", type=int, default=900, help="seconds per launch")
    add("--cluster", metavar="HxR", help="on H simulated hosts x R ranks, 2 in all (needs root, ip, tc: cluster.py)")
    add("--link", default="1gbit,10gbit", help="with --cluster: tc link rates, one run of each launch per link")
    add("--redraw", metavar="DIR", help="only redraw the report of DIR/results.json")
    return p.parse_args(argv)


class Job(NamedTuple):
    """One launch of the benchmark's worker: its progress line, arguments and accelerate config."""

    what: str
    args: list[str]
    config: dict | None  # None: torchrun, DDP on CPU


def cluster_of(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """--cluster HxR: H hosts, R ranks each for the 2-rank launches (the HSDP mesh: 4/H); --link."""
    try:
        hosts, per_host = (int(x) for x in args.cluster.lower().split("x"))
    except ValueError:
        hosts = per_host = 0
    if hosts < 1 or hosts * per_host != 2:
        raise SystemExit(
            f"--cluster {args.cluster}: expected HOSTSxRANKS with 2 ranks in all (2x1, or 1x2 for one host); "
            "the HSDP launch then runs 4 ranks as HOSTS x 4/HOSTS"
        )
    if args.grpo and hosts != 2:
        raise SystemExit(f"--cluster {args.cluster}: the GRPO benchmark runs 2 hosts x 1 rank (2x1)")
    links = [link.strip() for link in args.link.split(",") if link.strip()]
    try:
        for link in links:
            cluster.link_bits_per_s(link)
    except ValueError as e:
        raise SystemExit(f"--link: {e}") from None
    if not links:
        raise SystemExit("--link: give at least one bandwidth, such as 1gbit")
    return {"hosts": hosts, "ranks_per_host": per_host}, links


def plan_of(args: argparse.Namespace) -> tuple[dict, list[str | None]]:
    """The benchmark's plan and the networks it runs on (None: loopback; GRPO runs there too)."""
    p = grpo.plan_of(args) if args.grpo else mlp.plan(args)
    if not args.cluster:
        return p, [None]
    shape, links = cluster_of(args)
    if not args.grpo:
        p.update(cluster=shape, links=links)
    return p, [None, *links] if args.grpo else list(links)


def jobs_of(p: dict, args: argparse.Namespace, workdir: Path, network: str | None) -> list[Job]:
    """The launches of one network; the GRPO benchmark saves its model once, for every network."""
    if not args.grpo:
        return [
            Job(
                f"{size} model, {n} ranks: {', '.join(names)}",
                mlp.worker_args(p, size, names, args.device),
                fsdp2_config("Block", n),
            )
            for size, n, names in mlp.launches(p)
        ]
    if not (workdir / "bench_facts.json").exists():
        facts = grpo.build_model_dir(workdir, p["size"])
        what = f"{len(p['configs'])} configurations, {p['rounds']} round(s) of {p['steps']} steps"
        what += ", FSDP2's and DDP's launches alternating"
        print(f"[benchmarks] GRPO {p['size']} model, {facts['params'] / 1e6:.2f} M params: {what}", flush=True)
    pin = not args.no_pin and not network  # a cluster pins each host's launch to the host's cores
    profile = ["--profile", str(Path(args.out, "profiles", network or "loopback"))] if args.profile else []
    # DDP's configurations: no accelerate config, torchrun with accelerate on CPU (launch.py), which
    # makes it DDP over gloo (accelerate's MULTI_CPU launcher would want mpirun).
    return [
        Job(
            f"GRPO round {r + 1}/{p['rounds']}, {'DDP' if grpo.is_ddp(names[0]) else 'FSDP2'}: {', '.join(names)}",
            grpo.worker_args(p, workdir, pin, names, r) + profile,
            None if grpo.is_ddp(names[0]) else fsdp2_config(grpo.LAYER_CLASS, 2),
        )
        for r, names in grpo.launches(p)
    ]


def run_jobs(jobs: list[Job], network: str | None, p: dict, args: argparse.Namespace) -> list[RunBase]:
    """Every job on one network: loopback (None), or a simulated cluster with links of that rate."""
    # CPU: tensors over 1 MiB get their own mmap, returned to the OS when freed; otherwise glibc
    # keeps freed buffers, and a step's peak RSS would depend on which configuration ran before it.
    cpu = args.device == "cpu"
    env = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(2**20))} if cpu else {}
    if cpu or args.grpo:  # gloo beside any GPU (the GRPO benchmark runs on CPU whatever --device says)
        env["CUDA_VISIBLE_DEVICES"] = ""
    worker, merge = (grpo.WORKER, grpo.launch_of) if args.grpo else (mlp.WORKER, mlp.merge)
    hosts = p.get("cluster", {}).get("hosts", 2)
    runs = []
    with cluster.Cluster(hosts, network, cpus_per_host=not args.no_pin) if network else nullcontext() as c:
        for job in jobs:
            nranks = job.config["num_processes"] if job.config else 2
            print(f"[benchmarks] {f'{network} link, {c.hosts} hosts' if c else 'loopback'}, {job.what}", flush=True)
            t0, sent0 = time.time(), sum(c.link_bytes()) if c else 0
            done = launch(worker, job.args, job.config, env=env, timeout=args.timeout, hosts=c, echo=echo_progress)
            run = merge(done.check(f"{worker.name} ({job.what})", nranks))
            run.wall_s = round(time.time() - t0, 1)
            if c:
                run.link, run.hosts, run.ranks_per_host = (network, c.hosts, nranks // c.hosts)
                run.link_bytes = sum(c.link_bytes()) - sent0
            runs.append(run)
    return [grpo.combine(runs)] if args.grpo else runs  # GRPO: FSDP2's and DDP's launches as one run


def echo_progress(host: int, line: str) -> None:
    """The workers' progress lines (rank 0 prints them; on a cluster, host 0's)."""
    if line.startswith("[bench]"):
        print(("  " if host == 0 else f"  host {host}: ") + line, end="", flush=True)


def machine_facts(device: str) -> dict:
    """The machine a run ran on: CPU model and count, memory, platform, device type."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "device": device,
        **({"cpu_model": models[0]} if models else {}),
    }


def redraw(folder: Path) -> str:
    """Every file of a results folder again from its results.json; the target summary."""
    data = json.loads((folder / "results.json").read_text())
    if data.get("benchmark") == "grpo":
        return grpo_report.write_report(GrpoResults.from_dict(data), folder)
    return mlp_report.write_report(Results.from_dict(data), folder)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.redraw:
        print(redraw(Path(args.redraw)))
        return 0
    p, networks = plan_of(args)
    if any(networks) and (reason := cluster.unavailable_reason()):
        raise SystemExit(f"--cluster: {reason}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run for net in networks for run in run_jobs(jobs_of(p, args, Path(tmp), net), net, p, args)]
    command = "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)
    common = dict(command=command, plan=p, machine=machine_facts(args.device), elapsed_s=round(time.time() - start, 1))
    results = GrpoResults(**common, runs=runs) if args.grpo else Results(**common, runs=runs)
    (out / "results.json").write_text(json.dumps(dataclasses.asdict(results), indent=1))
    print(redraw(out))
    print(f"[benchmarks] wrote {out}/results.json, results.md, *.png in {results.elapsed_s} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
