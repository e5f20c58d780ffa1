"""Entry point: `python -m benchmarks.run [--quick] [--device cpu|cuda|npu] [--out benchmarks/results]`
(`--cluster 2x1 --link 1gbit,10gbit`: on simulated hosts).

Launches `benchmarks/worker.py` with `accelerate launch` and an FSDP2 config (2 ranks; 4 for
the 2x2 HSDP configurations), once per model size, merges what the ranks wrote into
`results.json`, then writes the Markdown table, the plots and the target summary (report.py).
On CPU the workers use gloo through `accel_gradsync.enable_cpu_fsdp()`; with `--device cuda`
or `npu` the same launch runs on NCCL/HCCL, unchanged.

With `--cluster HxR` (root only) the same launches run on H simulated hosts (`cluster.py`: network
namespaces joined by links shaped to each `--link` bandwidth), R ranks per host and the 4-rank
HSDP mesh as H hosts x 4/H ranks: one `accelerate launch` per host, as on a real cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import cluster, cluster_report, registry, report
from benchmarks.records import ConfigResult, RankResult, Results, Run

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("worker.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, M=1,2,4, few configs (CI smoke test)")
    p.add_argument(
        "--grpo",
        action="store_true",
        help="the GRPO benchmark instead (benchmarks/grpo.py): TRL's GRPOTrainer, stock and every sync mode, "
        "full fine-tuning and LoRA; over loopback, and with --cluster also per --link",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--sizes", help="comma-separated, from registry.SIZES")
    p.add_argument("--Ms", help="comma-separated micro-batch counts")
    p.add_argument("--configs", help="comma-separated, from registry.CONFIGS")
    p.add_argument("--reps", type=int, help="interleaved repetitions of every configuration")
    p.add_argument("--steps", type=int, help="timed optimizer steps per repetition and M (default: per model size)")
    p.add_argument("--no-pin", action="store_true", help="CPU: leave the ranks unpinned (default: one core per rank)")
    p.add_argument(
        "--hsdp-size",
        help=f"model size of the 4-rank HSDP launch (default: {registry.HSDP_SIZE}; the quick cluster run: small)",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument(
        "--cluster",
        metavar="HxR",
        help="run on H simulated hosts x R ranks (2x1): network namespaces joined by shaped links; "
        "needs root, ip and tc (benchmarks/cluster.py)",
    )
    p.add_argument(
        "--link",
        default="1gbit,10gbit",
        help="with --cluster: comma-separated link bandwidths in tc's spelling, one run of every "
        "launch per link (default: 1gbit,10gbit)",
    )
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> dict:
    if args.cluster:
        base = dict(registry.CLUSTER_QUICK if args.quick else registry.CLUSTER)
    else:
        base = dict(registry.QUICK if args.quick else registry.FULL)
    for key in ("sizes", "Ms", "configs"):
        if getattr(args, key):
            base[key] = getattr(args, key).split(",")
    for key in ("reps", "steps"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    base["Ms"] = [int(m) for m in base["Ms"]]
    base["hsdp_size"] = args.hsdp_size or base.get("hsdp_size", registry.HSDP_SIZE)
    base["quick"] = args.quick
    base["no_pin"] = args.no_pin
    unknown = [c for c in base["configs"] if c not in registry.CONFIGS] + [
        s for s in base["sizes"] if s not in registry.SIZES
    ]
    if unknown:
        raise SystemExit(f"unknown configuration or size: {', '.join(unknown)}")
    if args.cluster:
        base["cluster"] = cluster_shape(args.cluster)
        base["links"] = cluster_links(args.link)
    return base


def cluster_shape(spec: str) -> dict:
    """'2x1' -> 2 hosts, 1 rank each for the 2-rank launches (the 4-rank HSDP mesh: 2 each)."""
    try:
        hosts, per_host = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        hosts = per_host = 0
    if hosts < 1 or hosts * per_host != 2:
        raise SystemExit(
            f"--cluster {spec}: expected HOSTSxRANKS with 2 ranks in all (2x1, or 1x2 for one host); "
            "the HSDP launch then runs 4 ranks as HOSTS x 4/HOSTS"
        )
    return {"hosts": hosts, "ranks_per_host": per_host}


def cluster_links(spec: str) -> list[str]:
    links = [link.strip() for link in spec.split(",") if link.strip()]
    for link in links:
        try:
            cluster.link_bits_per_s(link)
        except ValueError as e:
            raise SystemExit(f"--link: {e}") from None
    if not links:
        raise SystemExit("--link: give at least one bandwidth, such as 1gbit")
    return links


def launches(p: dict) -> list[tuple[str, int, list[str]]]:
    """(size, ranks, configs) per launch: one process group per size for the 2-rank
    configurations, and one 4-rank group for HSDP on `hsdp_size` (4 processes on the machine:
    one size shows the trade-off)."""
    two = [c for c in p["configs"] if registry.ranks(c) == 2]
    four = [c for c in p["configs"] if registry.ranks(c) == 4]
    out = [(size, 2, two) for size in p["sizes"] if two]
    if four:
        out.append((p["hsdp_size"], 4, four))
    return out


def accelerate_config(nranks: int, device: str) -> dict:
    fsdp = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    # The same config on CPU, CUDA and NPU: on CPU the worker's enable_cpu_fsdp() makes it FSDP
    # over gloo; elsewhere accelerate picks NCCL/HCCL itself.
    config = {"distributed_type": "FSDP", "num_processes": nranks, "fsdp_config": fsdp, "mixed_precision": "no"}
    if nranks == 4:  # the 2x2 HSDP mesh: replicate x shard, as a user would configure it
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 2,
        }
    return config


def launch(
    size: str, nranks: int, names: list[str], p: dict, device: str, timeout: int, hosts: cluster.Cluster | None = None
) -> list[RankResult]:
    """One `accelerate launch` of the worker (with `hosts`: one per simulated host); what each rank wrote."""
    env = {}
    if device == "cpu":
        # Tensors over 1 MiB get their own mmap, returned to the OS when freed: without it glibc
        # keeps freed buffers (its mmap threshold grows to 32 MiB), and a step's peak RSS would
        # depend on which configuration ran before it.
        env = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(2**20))}
        env["OMP_NUM_THREADS"] = "1"  # ranks share the cores; oversubscription would dominate
        env["CUDA_VISIBLE_DEVICES"] = ""  # --device cpu means gloo even on a machine with GPUs
    config = accelerate_config(nranks, device)
    worker_args = [
        "--size",
        size,
        "--configs",
        ",".join(names),
        "--Ms",
        ",".join(map(str, p["Ms"])),
        "--reps",
        str(p["reps"]),
        "--steps",
        str(p["steps"] or registry.SIZES[size]["steps"]),
    ]
    if device == "cpu" and not p.get("no_pin"):
        worker_args.append("--pin-cores")
    ranks = launch_workers(WORKER, worker_args, config, env, timeout, hosts, f"{size}, {nranks} ranks")
    return [RankResult.from_dict(rank) for rank in ranks]


def launch_workers(
    script: Path,
    worker_args: list[str],
    config: dict,
    env: dict[str, str],
    timeout: int,
    hosts: cluster.Cluster | None,
    what: str,
) -> list[dict]:
    """`accelerate launch` of a benchmark worker with `config` (with `hosts`: the same launch on
    every simulated host, as a cluster job runs it), streaming its progress lines; the JSON each
    rank wrote to `--out`, in rank order."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("ACCEL_GRADSYNC_DEFER", None)  # the configuration alone chooses the mode
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp, "accelerate.yaml")
        if hosts is not None:
            config = {**config, "num_machines": hosts.hosts}
        cfg.write_text(yaml.safe_dump(config))
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg)]
        worker = [str(script), "--out", tmp, *worker_args]
        if hosts is None:
            cmd = [*launcher, "--main_process_port", str(free_port()), *worker]
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail, code = stream(proc, timeout), proc.returncode
        else:  # rank 0 (host 0) reports progress
            commands = [[*launcher, *hosts.accelerate_flags(h), *worker] for h in range(hosts.hosts)]
            done = hosts.run(commands, env, cwd=REPO, timeout=timeout, echo=echo_progress)
            code = next((c for c, _ in done if c != 0), 0)
            tail = [f"--- host {h} ---\n" + "".join(t) for h, (_, t) in enumerate(done)]
        files = sorted(Path(tmp).glob("rank*.json"))
        if code != 0 or len(files) != config["num_processes"]:
            raise RuntimeError(f"{script.name} failed ({what}, exit {code}):\n" + "".join(tail))
        return [json.loads(f.read_text()) for f in files]


def stream(proc: subprocess.Popen, timeout: int) -> list[str]:
    """Echo the workers' progress lines; keep the last lines for an error message."""
    deadline, tail = time.time() + timeout, []
    for line in proc.stdout:
        if line.startswith("[bench]"):
            print("  " + line, end="", flush=True)
        tail = (tail + [line])[-80:]
        if time.time() > deadline:
            proc.kill()
            tail.append(f"killed after {timeout} s\n")
            break
    proc.wait()
    return tail


def echo_progress(host: int, line: str) -> None:
    if line.startswith("[bench]"):
        print(f"  host {host}: " + line, end="", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merge(ranks: list[RankResult], nranks: int) -> Run:
    """One row per (configuration, M) from every rank and repetition.

    A step lasts as long as its slowest rank, so a step's time is the max over ranks; the
    median is over all timed steps of all repetitions. Collective counts and bytes are rank 0's
    (every rank issues the same collectives); memory is the max over ranks."""
    first = ranks[0]
    rows = []
    for j, rec in enumerate(first.records):
        per_rank = [rank.records[j] for rank in ranks]
        assert all((r.config, r.M) == (rec.config, rec.M) for r in per_rank), "ranks disagree on the records"
        steps = list(zip(*(r.steps for r in per_rank), strict=True))  # each timed step, on every rank
        times = [max(s.time_s for s in step) for step in steps]
        cpus = [max(s.cpu_s for s in step) for step in steps]
        every = [s for r in per_rank for s in r.steps]
        spec = registry.CONFIGS[rec.config]
        handle_held = [s.handle_held_grad_bytes for s in every if s.handle_held_grad_bytes is not None]
        device_peak = max((s.device_peak_bytes or 0) for s in every)
        rows.append(
            ConfigResult(
                config=rec.config,
                M=rec.M,
                label=spec["label"],
                group=spec["group"],
                step_time_s=statistics.median(times),
                step_times_s=times,
                step_rounds=[s.round for s in rec.steps],
                step_cpu_s=statistics.median(cpus),
                step_cpus_s=cpus,
                **{f"{kind}_per_step": statistics.median(getattr(s, kind) for s in rec.steps) for kind in KINDS},
                bytes_sent_per_step=statistics.median(s.bytes_sent for s in rec.steps),
                counts_seen_per_step={kind: sorted({getattr(s, kind) for s in rec.steps}) for kind in KINDS},
                held_grad_bytes=max(s.held_grad_bytes for s in every),
                held_param_bytes=max(s.held_param_bytes for s in every),
                handle_held_grad_bytes=max(handle_held) if handle_held else None,
                peak_rss_bytes=max(s.peak_rss_bytes for s in every),
                rss_growth_bytes=max(s.rss_growth_bytes for s in every),
                peak_rss_scope=rec.steps[0].peak_rss_scope,
                device_peak_bytes=device_peak or None,
                stats=rec.stats,
                # The slowest rank's cost of the sync choice per micro-batch (None: the Trainer).
                sync_control_us=max((r.sync_control_us or 0) for r in per_rank) or None,
            )
        )
    return Run(
        size=first.size,
        facts=first.facts,
        device=first.device,
        ranks=nranks,
        rows=rows,
        versions=first.versions,
        pinned_cores=[rank.pinned_core for rank in ranks],
    )


KINDS = ("reduce_scatters", "all_reduces", "all_gathers")


def machine_facts(device: str) -> dict:
    """The machine a run ran on: CPU model and count, memory, platform, device type."""
    import psutil

    out = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "device": device,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return out


def run_cluster(p: dict, args: argparse.Namespace) -> list[Run]:
    """Every launch on the simulated cluster, once per link bandwidth; each run records its link,
    its hosts and the bytes that crossed the shaped links (tbf's counters)."""
    reason = cluster.unavailable_reason()
    if reason:
        raise SystemExit(f"--cluster: {reason}")
    runs = []
    for link in p["links"]:
        with cluster.Cluster(p["cluster"]["hosts"], link, cpus_per_host=not p["no_pin"]) as hosts:
            for size, nranks, names in launches(p):
                t0, sent0 = time.time(), sum(hosts.link_bytes())
                per_host = nranks // hosts.hosts
                print(
                    f"[benchmarks] {link} link, {hosts.hosts} hosts x {per_host} ranks, {size} model: "
                    + ", ".join(names),
                    flush=True,
                )
                merged = merge(launch(size, nranks, names, p, args.device, args.timeout, hosts), nranks)
                merged.link, merged.hosts, merged.ranks_per_host = link, hosts.hosts, per_host
                merged.link_bytes = sum(hosts.link_bytes()) - sent0
                merged.wall_s = round(time.time() - t0, 1)
                runs.append(merged)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.grpo:
        from benchmarks import grpo

        return grpo.main(args)
    p = plan(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, load_before = time.time(), os.getloadavg()
    runs = run_cluster(p, args) if p.get("cluster") else []
    for size, nranks, names in [] if p.get("cluster") else launches(p):
        t0 = time.time()
        print(f"[benchmarks] {size} model, {nranks} ranks: {', '.join(names)}", flush=True)
        merged = merge(launch(size, nranks, names, p, args.device, args.timeout), nranks)
        merged.wall_s = round(time.time() - t0, 1)
        runs.append(merged)
    results = Results(
        command="python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        plan=p,
        machine=machine_facts(args.device),
        elapsed_s=round(time.time() - start, 1),
        # Other processes on the machine slow some configurations more than others; the load
        # average says how busy it was (interleaving spreads the rest of the noise evenly).
        load_average={"before": list(load_before), "after": list(os.getloadavg())},
        runs=runs,
    )
    (out / "results.json").write_text(json.dumps(dataclasses.asdict(results), indent=1))
    write = cluster_report.write_cluster_report if p.get("cluster") else report.write_report
    print(write(results, out))
    print(f"[benchmarks] wrote {out}/results.json, results.md, *.png in {results.elapsed_s} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
