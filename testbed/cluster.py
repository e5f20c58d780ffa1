"""A simulated cluster on one Linux machine: N "hosts" as network namespaces, joined through a
switch namespace (bridge br0) by veth links shaped with `tc`'s `tbf` to one bandwidth both ways
(bandwidth only: latency would need `netem`). Host h is 198.18.0.<h+1>/24 on its `eth0` (RFC 2544's
benchmark range); ranks on one host talk over its loopback, unshaped, as on a real node.

    with Cluster(hosts=2, link="1gbit") as cluster:
        done = cluster.run([argv_of_host0, argv_of_host1], env)   # one launch per host

Namespaces are named `agsc<pid>...` after the process that made them; `Cluster` removes its own
on exit, failure, Ctrl-C or SIGTERM, and at start any whose process no longer exists. Needs root
and `ip`/`tc`; `unavailable_reason()` says why not.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import psutil

PREFIX = "agsc"
SUBNET = "198.18.0"  # RFC 2544 benchmark range; host h is .h+1
NIC = "eth0"  # the host's interface name inside its namespace: what GLOO_SOCKET_IFNAME names
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)bit$")
_OWN = re.compile(rf"^{PREFIX}(\d+)[sh]\d*$")


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the simulated cluster (not root, no `ip`/`tc`, no netns)."""


def link_bits_per_s(link: str) -> float:
    """'1gbit' -> 1e9. tc's own spelling of a rate, so the value given is the one tc applies."""
    m = _RATE.match(link.strip().lower())
    if not m:
        raise ValueError(f"link bandwidth {link!r}: expected a tc rate such as 100mbit, 1gbit or 10gbit")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def unavailable_reason() -> str | None:
    """Why the simulated cluster cannot run here, or None when it can. Tries a namespace for real
    (root in a container may still lack CAP_NET_ADMIN)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces and tc); run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the simulated cluster needs {' and '.join(missing)} (iproute2); install iproute2"
    probe = f"{PREFIX}{os.getpid()}s99"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _sh(*f"tc -n {probe} qdisc add dev p0 root tbf rate 1gbit burst 1mb latency 50ms".split())
    except subprocess.CalledProcessError as e:
        return f"the simulated cluster cannot build namespaces or tbf links here: {e.stderr.strip() or e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def remove_leftovers() -> None:
    """Delete the namespaces of clusters whose process no longer exists (with them go the veth ends
    and the bridge inside), and veths a crash left in the root namespace before moving them."""
    for line in _sh("ip", "netns", "list").splitlines():
        m = _OWN.match(line.split()[0] if line.strip() else "")
        if m and not psutil.pid_exists(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True)
    for line in _sh("ip", "-o", "link", "show").splitlines():
        m = re.match(rf"^\d+: ({PREFIX}(\d+)[vb]\d+)[@:]", line)
        if m and not psutil.pid_exists(int(m.group(2))):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)


class Cluster:
    """`hosts` network namespaces, each with one NIC shaped to `link` (tc's spelling), for the duration
    of a `with`. `cpus_per_host`: each host's processes on its own share of this process's cores."""

    def __init__(self, hosts: int, link: str, cpus_per_host: bool = True) -> None:
        if hosts < 1 or hosts > 250:
            raise ValueError(f"hosts={hosts}: expected 1 to 250 simulated hosts")
        self.hosts, self.link, self.rate, self.cpus_per_host = hosts, link, link_bits_per_s(link), cpus_per_host
        tag = f"{PREFIX}{os.getpid()}"
        self.switch, self.namespaces = f"{tag}s", [f"{tag}h{h}" for h in range(hosts)]
        self._veth = [(f"{tag}v{h}", f"{tag}b{h}") for h in range(hosts)]
        self._made: list[str] = []
        self._old_handler = None

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> Cluster:
        if reason := unavailable_reason():
            raise ClusterUnavailable(reason)
        remove_leftovers()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM's default kills without running `finally`: raise SystemExit instead while the
            # cluster exists, so `__exit__` still removes it (Ctrl-C already raises).
            self._old_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        # tbf needs a bucket of at least one timer tick's worth of bytes at the rate (HZ may be
        # 100), or it cannot reach the rate; a queue of 50 ms bounds the backlog it buffers.
        burst = f"{max(64 * 1024, int(self.rate / 8 / 100))}b"
        shape = ["root", "tbf", "rate", self.link, "burst", burst, "latency", "50ms"]
        self._add_namespace(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            host_end, switch_end = self._veth[h]
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            try:
                _sh("ip", "link", "set", host_end, "netns", ns)
                _sh("ip", "link", "set", switch_end, "netns", self.switch)
            except subprocess.CalledProcessError:
                subprocess.run(["ip", "link", "del", host_end], capture_output=True)
                raise
            _sh("ip", "-n", ns, "link", "set", host_end, "name", NIC)
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", NIC)
            _sh("ip", "-n", ns, "link", "set", NIC, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")  # ranks of one host talk over loopback
            _sh("ip", "-n", self.switch, "link", "set", switch_end, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", switch_end, "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", NIC, *shape)  # host -> switch
            _sh("tc", "-n", self.switch, "qdisc", "add", "dev", switch_end, *shape)  # switch -> host

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Remove every namespace this cluster made (and with them its veths and bridge)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def link_bytes(self) -> list[int]:
        """Bytes each host has sent through its shaped NIC so far (tbf's counter)."""
        sent = [
            re.search(r"Sent (\d+) bytes", _sh("tc", "-n", ns, "-s", "qdisc", "show", "dev", NIC))
            for ns in self.namespaces
        ]
        return [int(m.group(1)) if m else 0 for m in sent]

    def host_cpus(self, host: int) -> set[int]:
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // self.hosts
        return set(cores[host * per : (host + 1) * per]) if per else {cores[host % len(cores)]}

    def accelerate_flags(self, host: int, port: int = 29500) -> list[str]:
        """What `accelerate launch` needs on each host, as on a real cluster
        (recipes/slurm_multi_node.sh): the namespaces have their own ports, so a fixed one works."""
        flags = {
            "num_machines": self.hosts,
            "machine_rank": host,
            "main_process_ip": self.address(0),
            "main_process_port": port,
        }
        return [arg for name, value in flags.items() for arg in (f"--{name}", str(value))]

    def torchrun_flags(self, host: int, nprocs: int, port: int = 29500) -> list[str]:
        """What torchrun needs on each host for a multi-node job of `nprocs` ranks in all (DDP's
        launch, which has no accelerate config): host 0 is the rendezvous, as in `accelerate_flags`."""
        return [
            f"--nnodes={self.hosts}",
            f"--node_rank={host}",
            f"--nproc_per_node={nprocs // self.hosts}",
            f"--master_addr={self.address(0)}",
            f"--master_port={port}",
        ]

    def popen(self, host: int, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """Start `argv` in host `host`'s namespace, gloo bound to its NIC, in a session of its own."""
        cpus = self.host_cpus(host) if self.cpus_per_host else None
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        argv, env = ["ip", "netns", "exec", self.namespaces[host], *argv], {**env, "GLOO_SOCKET_IFNAME": NIC}
        return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=pin, **kwargs)

    def run(
        self,
        argvs: list[list[str]],
        env: dict,
        cwd=None,
        timeout: float = 900,
        echo: Callable[[int, str], None] | None = None,
    ) -> list[tuple[int, list[str]]]:
        """One command per host, all at once (`run_all`); (exit code, last 80 output lines) per host."""
        if len(argvs) != self.hosts:
            raise ValueError(f"{len(argvs)} commands for {self.hosts} hosts: one per host")
        pipe = {"cwd": cwd, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        starts = [functools.partial(self.popen, h, argv, env, **pipe) for h, argv in enumerate(argvs)]
        return run_all(starts, timeout, echo)


def run_all(starts: list[Callable], timeout: float, echo=None, keep: int = 80) -> list[tuple[int, list[str]]]:
    """Start each process (output piped, own session) and wait for all, keeping each one's last `keep`
    lines (`echo(index, line)` sees each); when one fails or the timeout passes, stop every tree, as
    the others' ranks would wait in a collective until gloo's timeout. (exit code, lines) each."""
    procs, tails, readers = [], [[] for _ in starts], []
    try:
        for h, start in enumerate(starts):
            procs.append(start())
            readers.append(threading.Thread(target=drain, args=(procs[h], tails[h], h, echo, keep), daemon=True))
            readers[-1].start()
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.time() > deadline:
                if not failed:
                    tails[0].append(f"killed after {timeout} s\n")
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            stop_tree(p)
        for r in readers:
            r.join(timeout=5)
    return [(p.returncode, tail) for p, tail in zip(procs, tails, strict=True)]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def drain(proc: subprocess.Popen, tail: list[str], host: int, echo, keep: int = 80) -> None:
    """Read `proc`'s output to its end, keeping the last `keep` lines in `tail`; `echo(host, line)` sees each."""
    for line in proc.stdout:
        if echo:
            echo(host, line)
        tail.append(line)
        del tail[:-keep]


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a host's launch and everything it started (its own session), if still running."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if proc.poll() is None else ():
        try:
            os.killpg(proc.pid, sig)
            proc.wait(10)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    proc.wait()
