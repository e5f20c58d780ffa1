"""The recipe's launch ends the way a user expects, every time.

- A finished run exits 0, never SIGABRT at interpreter exit ("terminate called without an
  active exception": gloo's worker threads against interpreter finalization, see
  accel_gradsync/compat/teardown.py). The stress test (slow) runs it 30 times with two busy loops
  competing for the cores.
- A rank killed mid-step ends the launch within seconds, non-zero, naming the rank.
- Ctrl-C (SIGINT to the launcher) stops every rank promptly and leaves no model in output_dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from launcher import REPO, recipe_launch

QUICK = ["--max_steps", "3", "--save_strategy", "no", "--disable_tqdm", "true"]
LONG = ["--max_steps", "100000", "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]


class Launch:
    """`accelerate launch` of the recipe in the background, its output collected as it comes."""

    def __init__(self, config: str, flags: list[str], out_dir: Path) -> None:
        cmd, env = recipe_launch(
            [
                "--config_file",
                f"accelerate_configs/{config}.yaml",
                "recipes/grpo.py",
                *flags,
                "--output_dir",
                str(out_dir),
            ]
        )
        # Its own session, so a signal meant for it never reaches pytest, and cleanup finds every rank.
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"never printed {text!r} (exit {self.proc.poll()}):\n{self.output[-4000:]}")
            time.sleep(0.1)

    def ranks(self) -> dict[int, psutil.Process]:
        """The launched training processes by rank (children of the launcher with RANK set)."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rank = child.environ().get("RANK")
                if rank is not None and "recipes/grpo.py" in " ".join(child.cmdline()):
                    found[int(rank)] = child
        return found

    def finish(self, timeout: float) -> int:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def launches():
    started: list[Launch] = []

    def start(*args) -> Launch:
        started.append(Launch(*args))
        return started[-1]

    yield start
    for launch in started:  # nothing outlives a test, whatever it asserted
        if launch.proc.poll() is None:
            launch.kill_all()


def training_started(launch: Launch) -> dict[int, psutil.Process]:
    """Wait until both ranks are past their first logged optimizer step; return them by rank."""
    launch.wait_for("'grad_sync/reduce_scatters'")
    ranks = launch.ranks()
    assert sorted(ranks) == [0, 1], launch.output[-3000:]
    return ranks


@pytest.mark.parametrize("config", ["fsdp2", pytest.param("fsdp1", marks=pytest.mark.slow)])
def test_a_rank_killed_mid_step_ends_the_launch_within_seconds_naming_it(launches, tmp_path, config):
    launch = launches(config, ["--defer-grad-sync", *LONG], tmp_path / "out")
    ranks = training_started(launch)
    ranks[1].kill()  # SIGKILL: no handler, no goodbye to the peer
    killed = time.monotonic()
    code = launch.finish(timeout=120)
    elapsed = time.monotonic() - killed
    assert code != 0
    assert elapsed < 30, f"the launch took {elapsed:.0f} s to notice a dead rank"
    assert "local_rank: 1" in launch.output and "SIGKILL" in launch.output, launch.output[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks.values())


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2", "fsdp1"])
def test_ctrl_c_stops_every_rank_promptly_and_leaves_no_model(launches, tmp_path, config):
    out_dir = tmp_path / "out"
    launch = launches(config, ["--defer-grad-sync", *LONG], out_dir)
    ranks = training_started(launch)
    launch.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = launch.finish(timeout=120)
    elapsed = time.monotonic() - sent
    assert code != 0
    assert elapsed < 30, f"Ctrl-C took {elapsed:.0f} s to stop the run"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks.values())
    left = sorted(p.name for p in out_dir.glob("*")) if out_dir.exists() else []
    assert not [n for n in left if n.endswith((".safetensors", ".bin", ".pt"))], left
    assert not Path(str(out_dir) + ".saving").exists()


# Short runs of every quick-start combination, in turn.
COMBINATIONS = [("fsdp2", ["--defer-grad-sync"]), ("fsdp2", []), ("fsdp1", ["--defer-grad-sync"]), ("fsdp1", [])]


@contextlib.contextmanager
def busy_cores(n: int = 2):
    """`n` busy loops competing for the cores, as on a shared machine."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@pytest.mark.slow
def test_thirty_short_runs_under_load_all_exit_zero(tmp_path):
    failures = []
    with busy_cores(2):
        for i in range(30):
            config, flags = COMBINATIONS[i % len(COMBINATIONS)]
            cmd, env = recipe_launch(
                [
                    "--config_file",
                    f"accelerate_configs/{config}.yaml",
                    "recipes/grpo.py",
                    *flags,
                    *QUICK,
                    "--output_dir",
                    str(tmp_path / f"run{i}"),
                ]
            )
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                failures.append(f"run {i} ({config} {flags}): exit {proc.returncode}\n{proc.stderr[-2000:]}")
    assert not failures, f"{len(failures)} of 30 runs failed:\n" + "\n".join(failures)
