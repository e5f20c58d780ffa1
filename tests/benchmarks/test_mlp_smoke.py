"""Smoke test of the MLP benchmark: `python -m benchmarks.run --quick` end to end (2 gloo
ranks, about a minute). It checks the outputs exist and the collective counts, which are exact;
it never asserts on timings, which depend on the machine and its neighbours."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.records import Results  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, proc.stdout, Results.from_dict(json.loads((out / "results.json").read_text()))


def test_writes_json_markdown_and_plots(quick_run):
    out, _, results = quick_run
    for name in ("results.json", "results.md", "step_time_vs_M.png", "memory_vs_time.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "step_time_vs_M.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| per_micro_batch | 4 |" in md and "| deferred | 4 |" in md


def test_reduce_scatters_per_step_are_M_times_U_vs_U(quick_run):
    _, _, results = quick_run
    (run,) = results.runs
    U = run.facts["units"]
    rows = {(r.config, r.M): r for r in run.rows}
    for M in results.plan["Ms"]:
        # Every timed step of every repetition, on rank 0: the set of counts seen is one value.
        assert rows[("per_micro_batch", M)].counts_seen_per_step["reduce_scatters"] == [M * U]
        assert rows[("stock_sync_each_batch", M)].counts_seen_per_step["reduce_scatters"] == [M * U]
        for name in ("deferred", "stock_accumulate", "raw_fsdp2"):
            assert rows[(name, M)].counts_seen_per_step["reduce_scatters"] == [U], name
        # Deferral skips reduce-scatters only: forward/backward all-gathers are the same.
        assert rows[("deferred", M)].all_gathers_per_step == rows[("per_micro_batch", M)].all_gathers_per_step


def test_windowed_gathers_each_unit_once_per_step_and_holds_the_params(quick_run):
    _, _, results = quick_run
    (run,) = results.runs
    U, params = run.facts["units"], run.facts["params"]
    rows = {(r.config, r.M): r for r in run.rows}
    for M in results.plan["Ms"]:
        for name in ("windowed", "raw_windowed"):
            assert rows[(name, M)].counts_seen_per_step["all_gathers"] == [U], (name, M)
            assert rows[(name, M)].counts_seen_per_step["reduce_scatters"] == [U], (name, M)
    M = max(results.plan["Ms"])
    # Between micro-batches windowed keeps every unsharded fp32 param; per-micro-batch keeps none.
    assert rows[("windowed", M)].held_param_bytes == rows[("raw_windowed", M)].held_param_bytes == params * 4
    assert rows[("per_micro_batch", M)].held_param_bytes == 0


def test_held_gradient_bytes_follow_the_mode(quick_run):
    _, _, results = quick_run
    (run,) = results.runs
    rows = {(r.config, r.M): r for r in run.rows}
    full, M = run.facts["full_defer_grad_bytes"], max(results.plan["Ms"])
    assert rows[("deferred", M)].held_grad_bytes >= full  # the whole unsharded gradient
    assert rows[("per_micro_batch", M)].held_grad_bytes < full  # only the rank's shards


def test_summary_reports_every_target(quick_run):
    _, stdout, _ = quick_run
    assert "[PASS] reduce-scatters per step" in stdout
    for target in (
        "raw-API loop",
        "sync_each_batch=True",
        "communication-bound",
        "budget modes",
        "HSDP",
        "within",
        "hand-written windowed loop",
        "all-gathers per step = U",
    ):
        assert target in stdout, target
