"""The simulated cluster (testbed/cluster.py): hosts as network namespaces joined by links
shaped with tc's tbf, one `accelerate launch` per host.

What needs root, `ip` and `tc` skips with the reason when they are missing. The quick benchmark
on 2 hosts (~40 s) runs in CI's default run; the GRPO recipe on 2 hosts x 2 ranks of HSDP is slow.
Nothing here asserts on time: the shaping is checked by tbf's own counters (it held packets back,
it counted the bytes), the collectives by counting them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from testbed import cluster
from testbed.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
COUNTER = Path(__file__).parent / "recipe_counter"
UNAVAILABLE = cluster.unavailable_reason()
needs_cluster = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def our_namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{cluster.PREFIX}{pid}")]


def python_snippet(code: str, **kwargs) -> subprocess.Popen:
    """Run `code` in a fresh Python with Ctrl-C's default action, as in a terminal: a suite started
    in the background of a non-interactive shell inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def test_a_link_that_is_not_a_tc_rate_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'1gb'.*100mbit, 1gbit or 10gbit"):
        Cluster(2, "1gb")
    assert cluster.link_bits_per_s("10gbit") == 1e10 and cluster.link_bits_per_s("100mbit") == 1e8


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) to drop root")
def test_without_root_it_refuses_and_says_so():
    """A user namespace whose uid is not 0 has no say over the machine's network: a real non-root run."""
    script = "import sys; sys.path.insert(0, '.')\nfrom testbed.cluster import Cluster\nwith Cluster(2, '1gbit'): pass"
    command = ["unshare", "--user", "--map-user=1000", sys.executable, "-c", script]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    if "Traceback" not in proc.stderr:  # unshare itself failed: Python never ran
        pytest.skip(f"cannot make a user namespace here: {proc.stderr.strip()}")
    assert proc.returncode != 0
    assert "ClusterUnavailable: the simulated cluster needs root" in proc.stderr, proc.stderr


@needs_cluster
def test_without_ip_or_tc_it_refuses_naming_them():
    proc = subprocess.run(
        [sys.executable, "-c", "from testbed.cluster import unavailable_reason as u; print(u())"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "the simulated cluster needs ip and tc (iproute2); install iproute2", proc


@needs_cluster
def test_the_benchmark_refuses_a_cluster_it_cannot_build_before_launching(tmp_path):
    argv = [sys.executable, "-m", "benchmarks.run", "--cluster", "2x1", "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "PATH": "/nonexistent"}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "--cluster: the simulated cluster needs ip and tc" in proc.stderr
    assert not (tmp_path / "results.json").exists()


@needs_cluster
def test_hosts_talk_through_the_shaped_link_and_nowhere_else():
    with Cluster(2, "100mbit") as c:
        for h, ns in enumerate(c.namespaces):
            routes = subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True).stdout
            # Only the test subnet: no default route, so nothing leaves for the machine's network.
            assert routes.split()[:1] == ["198.18.0.0/24"] and "default" not in routes, routes
            assert (
                f"inet {c.address(h)}/24"
                in subprocess.run(["ip", "-n", ns, "addr"], capture_output=True, text=True).stdout
            )
        sent_before = c.link_bytes()
        size = 8 * 2**20
        receiver = c.popen(
            1,
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import socket
            s = socket.socket(); s.bind(("{c.address(1)}", 5555)); s.listen(1); print("ready", flush=True)
            conn, _ = s.accept(); n = 0
            while (d := conn.recv(1 << 20)): n += len(d)
            print(n)"""),
            ],
            os.environ,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert receiver.stdout.readline().strip() == "ready"
        sender = c.popen(
            0,
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
            import socket
            s = socket.create_connection(("{c.address(1)}", 5555)); s.sendall(bytes({size})); s.close()"""),
            ],
            os.environ,
        )
        assert sender.wait(120) == 0
        assert int(receiver.communicate(timeout=120)[0]) == size
        sent = [after - before for after, before in zip(c.link_bytes(), sent_before, strict=True)]
        assert sent[0] >= size  # host 0's NIC carried the payload (and its headers)
        assert sent[1] < size // 10  # host 1 only acknowledged
        stats = subprocess.run(
            ["tc", "-n", c.namespaces[0], "-s", "qdisc", "show", "dev", cluster.NIC], capture_output=True, text=True
        ).stdout
        # tbf held packets back: 8 MiB faster than 100 Mbit/s would allow, so the shaper acted.
        assert "rate 100Mbit" in stats and int(re.search(r"overlimits (\d+)", stats).group(1)) > 0, stats


@needs_cluster
def test_everything_is_removed_on_exit_and_on_error():
    with Cluster(2, "1gbit") as c:
        assert sorted(our_namespaces(os.getpid())) == sorted([c.switch, *c.namespaces])
    assert our_namespaces(os.getpid()) == []
    with pytest.raises(RuntimeError, match="boom"), Cluster(3, "1gbit"):
        assert len(our_namespaces(os.getpid())) == 4
        raise RuntimeError("boom")
    assert our_namespaces(os.getpid()) == []
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count(cluster.PREFIX) == 0


@needs_cluster
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_signalled_run_removes_its_cluster(how):
    proc = python_snippet("""
        import time
        from testbed.cluster import Cluster
        with Cluster(2, "1gbit"):
            print("up", flush=True)
            time.sleep(120)
        """)
    assert proc.stdout.readline().strip() == "up", proc.stderr.read()
    assert len(our_namespaces(proc.pid)) == 3
    proc.send_signal(getattr(signal, how))
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert our_namespaces(proc.pid) == []


@needs_cluster
def test_a_crashed_runs_leftovers_are_removed_by_the_next_cluster():
    proc = python_snippet("""
        import os
        from testbed.cluster import Cluster
        Cluster(2, "1gbit").__enter__()
        os._exit(9)  # no finally, no atexit: what a kill -9 leaves
        """)
    proc.communicate(timeout=60)
    assert proc.returncode == 9
    assert len(our_namespaces(proc.pid)) == 3  # left behind
    with Cluster(2, "1gbit"):
        assert our_namespaces(proc.pid) == []


@pytest.mark.slow  # the whole benchmark over the link; the links themselves are tested above
@needs_cluster
def test_quick_benchmark_on_two_simulated_hosts(tmp_path):
    """`python -m benchmarks.run --cluster 2x1 --link 1gbit --quick`: one accelerate launch per
    host; exact collective counts, and the collectives' bytes crossed the shaped links."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--cluster",
            "2x1",
            "--link",
            "1gbit",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-6000:]}"
    assert our_namespaces(proc.pid) == []
    results = json.loads((tmp_path / "results.json").read_text())
    plain, hsdp = results["runs"]
    assert (plain["hosts"], plain["ranks_per_host"], hsdp["hosts"], hsdp["ranks_per_host"]) == (2, 1, 2, 2)
    for run in results["runs"]:
        U = run["facts"]["units"]
        seen = {(r["config"], r["M"]): r["counts_seen_per_step"] for r in run["rows"]}
        for M in results["plan"]["Ms"]:
            want = {
                "per_micro_batch": (M * U, 0),
                "deferred": (U, 0),
                "windowed": (U, 0),
                "hsdp_per_micro_batch": (M * U, M * U),
                "hsdp_defer_all_reduce": (M * U, U),
            }
            for name, (rs, ar) in want.items():
                if (name, M) in seen:
                    assert (seen[(name, M)]["reduce_scatters"], seen[(name, M)]["all_reduces"]) == ([rs], [ar]), name
    # 1 rank per host: every collective crosses the link; the ring formula is the least it sends.
    timed = 2 * sum(r["bytes_sent_per_step"] * len(r["step_times_s"]) for r in plain["rows"])
    assert plain["link_bytes"] >= timed > 0
    assert hsdp["link_bytes"] > 0  # the replicas' all-reduces crossed it too
    assert "[PASS] [1gbit] collectives crossed the shaped link" in stdout
    assert (tmp_path / "speedup_vs_link.png").read_bytes()[:4] == b"\x89PNG"
    assert "## 1gbit link per host" in (tmp_path / "results.md").read_text()


@needs_cluster
def test_a_launch_without_an_accelerate_config_is_one_torchrun_per_host():
    """DDP's launch in the GRPO benchmark (torchrun, no accelerate config) on 2 hosts: one rank each,
    host 0 the rendezvous, one process group whose all-reduce crosses the shaped link."""
    from testbed.launch import launch

    with Cluster(2, "1gbit") as c:
        before = sum(c.link_bytes())
        done = launch(Path(__file__).parent / "workers" / "link_all_reduce.py", [], None, hosts=c, timeout=180)
        sent = sum(c.link_bytes()) - before
    assert done.returncode == 0, done.output
    assert [(r["rank"], r["world"], r["sum"]) for r in done.ranks] == [(0, 2, 2.0), (1, 2, 2.0)]
    assert sent >= 2 * 8 * 2**20  # each host sent at least the 8 MiB (2(N-1)/N of it, N = 2)


# -- the multi-node recipe path ---------------------------------------------------------------
STEPS, MICRO_BATCHES = 2, 4  # the recipe's default gradient_accumulation_steps
RECIPE_FLAGS = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true"]


def hsdp_config_for(tmp: Path, hosts: int, ranks_per_host: int) -> Path:
    """accelerate_configs/hsdp.yaml sized to the simulated cluster, as its comments say to: the
    process count and shard size follow the devices per node; nothing else changes."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "hsdp.yaml").read_text())
    assert config["num_machines"] == hosts == config["parallelism_config"]["parallelism_config_dp_replicate_size"]
    config["num_processes"] = hosts * ranks_per_host
    config["parallelism_config"]["parallelism_config_dp_shard_size"] = ranks_per_host
    path = tmp / "hsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch_recipe_on_cluster(c: Cluster, config: Path, flags: list[str], tmp: Path) -> list[dict]:
    """recipes/slurm_multi_node.sh's launch line on every host, the addresses those of the cluster."""
    counters = tmp / "counters"
    counters.mkdir(parents=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "RECIPE_COUNTER_DIR": str(counters),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(COUNTER), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("ACCEL_GRADSYNC_DEFER", None)
    argvs = [
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            *c.accelerate_flags(h),
            "recipes/grpo.py",
            *flags,
            *RECIPE_FLAGS,
            "--output_dir",
            str(tmp / "out"),
        ]
        for h in range(c.hosts)
    ]
    done = c.run(argvs, env, cwd=REPO, timeout=900)
    for h, (code, tail) in enumerate(done):
        assert code == 0, f"host {h} exit {code}:\n" + "".join(tail)
    return [json.loads(p.read_text()) for p in sorted(counters.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


@pytest.mark.slow
@needs_cluster
def test_grpo_recipe_on_two_hosts_defers_the_cross_host_all_reduces(tmp_path):
    """recipes/grpo.py with HSDP on 2 simulated hosts x 2 ranks (sharded over each host's
    loopback, replicated over the 1 Gbit/s link): counted from outside, all-reduce deferral
    removes (M-1) x U cross-host all-reduces per step and keeps every reduce-scatter."""
    config = hsdp_config_for(tmp_path, hosts=2, ranks_per_host=2)
    runs = {}
    with Cluster(2, "1gbit") as c:
        for mode in ("per_micro_batch", "defer_all_reduce"):
            runs[mode] = launch_recipe_on_cluster(c, config, ["--grad-sync-mode", mode], tmp_path / mode)
    cross_host = {"0,2", "1,3"}  # the replicate groups: rank r of host 0 with rank r of host 1
    for per_mb, deferred in zip(runs["per_micro_batch"], runs["defer_all_reduce"], strict=True):
        units = per_mb["fsdp2_reducing_groups"]
        assert units >= 3 and deferred["fsdp2_reducing_groups"] == units
        assert len([m for m in per_mb["fsdp2_modules"] if m.endswith("Qwen2DecoderLayer")]) == 2
        groups = [g for g in per_mb["all_reduces_by_group"] if g in cross_host]
        assert len(groups) == 1, per_mb["all_reduces_by_group"]  # each rank has one replica peer, on the other host
        (group,) = groups
        removed = per_mb["all_reduces_by_group"][group] - deferred["all_reduces_by_group"].get(group, 0)
        assert removed == STEPS * (MICRO_BATCHES - 1) * units, (per_mb, deferred)
        # Only the cross-host all-reduces change: the in-host reduce-scatters stay per micro-batch.
        rs = [
            sum(r["counts"].get(n, 0) for n in ("reduce_scatter_single", "reduce_scatter_tensor"))
            for r in (per_mb, deferred)
        ]
        assert rs[0] == rs[1] == STEPS * MICRO_BATCHES * units
        assert {g: n for g, n in per_mb["all_reduces_by_group"].items() if g != group} == {
            g: n for g, n in deferred["all_reduces_by_group"].items() if g != group
        }
