"""Smoke test of the GRPO benchmark: `python -m benchmarks.run --grpo --quick --beta 0.04` end to end
(TRL's real GRPOTrainer with a reference model, 2 gloo ranks, FSDP2, every configuration, and DDP in
a launch of its own; about two minutes). It checks the outputs, the exact collective counts (the
reference model's at every step), the DDP floor's lines and that every configuration reproduces
stock's completions, rewards, KL and losses; it never asserts on timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import grpo
from benchmarks.records import GrpoResults

# The whole GRPO benchmark over every configuration: with --slow (the MLP smoke test runs the same
# harness by default, and the GRPO records' round trip is tested in test_grpo_report.py).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_bench")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--grpo", "--quick", "--beta", "0.04", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = GrpoResults.from_dict(json.loads((out / "results.json").read_text()))
    (run,) = results.runs
    return out, proc.stdout, {r.config: r for r in run.rows}, run


def test_writes_json_markdown_and_the_step_split_plot(quick_run):
    out, _, rows, _ = quick_run
    assert (out / "grpo_step_split.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| full/windowed |" in md and "| lora/stock |" in md
    assert set(rows) == set(grpo.CONFIGS)  # every configuration ran


def test_every_step_is_split_into_phases_that_add_up(quick_run):
    _, _, rows, _ = quick_run
    for name, row in rows.items():
        assert row.phase_time_s["generation"] > 0 and row.phase_time_s["training"] > 0, name
        # The phases partition the step: their medians add up to about the median step.
        assert sum(row.phase_time_s.values()) == pytest.approx(row.step_time_s, rel=0.25), name


def test_gradient_sync_counts_follow_the_mode(quick_run):
    _, _, rows, run = quick_run
    M = run.facts["M"]
    for tuning in grpo.TUNINGS:
        stock = rows[f"{tuning}/stock"].counts_seen["training"]["reduce_scatters"]
        (units_reducing,) = stock  # stock accelerate defers: one reduce-scatter per reducing unit
        for mode in ("deferred", "windowed", "auto"):
            assert rows[f"{tuning}/{mode}"].counts_seen["training"]["reduce_scatters"] == stock, (tuning, mode)
        pmb = rows[f"{tuning}/per_micro_batch"].counts_seen["training"]["reduce_scatters"]
        assert pmb == [M * units_reducing], tuning
        for row in (r for n, r in rows.items() if n.startswith(tuning)):
            # Generation never reduces gradients.
            assert row.counts_seen["generation"]["reduce_scatters"] == [0], row.config


def test_windowed_gathers_each_unit_once_per_step_under_full_fine_tuning(quick_run):
    _, stdout, rows, _ = quick_run
    window, stock = rows["full/windowed"], rows["full/stock"]
    U = window.units
    seen = window.counts_seen
    assert seen["generation"]["all_gathers"] == [U] and seen["training"]["all_gathers"] == [0]
    # Stock re-gathers the units at every decode step and every micro-batch.
    assert stock.counts_seen["generation"]["all_gathers"][0] > 2 * U
    assert window.held_param_bytes > 0 and stock.held_param_bytes == 0
    assert "[PASS] [loopback] full/windowed: the trained model's all-gathers per optimizer step = U exactly" in stdout


def test_the_reference_model_gathers_once_per_step_with_the_plugin_and_once_per_run_kept_resident(quick_run):
    _, stdout, rows, run = quick_run
    M = run.facts["M"]
    # TRL's reference model: one unit, one forward per micro-batch's completions, stock re-gathers it each time.
    assert rows["full/stock"].counts_seen["logprob"]["all_gathers"] == [M]
    assert rows["full/stock"].logprob_gathers == [[M, M]] and rows["full/stock"].ref_units == 1
    for mode in ("per_micro_batch", "deferred", "deferred_gen_resident"):
        assert rows[f"full/{mode}"].logprob_gathers == [[1, 1]], mode
        assert rows[f"full/{mode}"].ref_unsharded_bytes == 0, mode  # resharded after its pass
    # Windowed keeps it unsharded: gathered at its first forward, in step 1, never again.
    window = rows["full/windowed"]
    assert window.logprob_gathers == [[1, 0]] and window.counts_seen["logprob"]["all_gathers"] == [0]
    ref_bytes = 4 * run.facts["params"]  # fp32: the reference model is a copy of the model
    assert window.ref_unsharded_bytes == ref_bytes
    assert window.state_bytes == rows["full/deferred"].state_bytes + ref_bytes
    assert "[PASS] [loopback] full/windowed: the reference model's all-gathers per step = 0 after step 1" in stdout
    assert "[loopback] lora/windowed: the reference model's" not in stdout  # LoRA: no model of its own


def test_ddp_is_the_floor_every_configuration_is_measured_against(quick_run):
    _, stdout, rows, _ = quick_run
    for tuning in grpo.TUNINGS:
        ddp, window = rows[f"{tuning}/ddp"], rows[f"{tuning}/windowed"]
        assert ddp.units == 0 and ddp.counts_seen["training"]["all_gathers"] == [0]  # parameters replicated
        # Sharded between optimizer steps; LoRA's frozen base kept unsharded for the run is its own line.
        assert (window.resident_bytes > 0) == (tuning == "lora")
        assert 0 < window.state_bytes - window.resident_bytes < ddp.state_bytes
        assert f"[loopback] {tuning}/windowed within 1.10x of {tuning}/ddp's GRPO step" in stdout
        assert f"[PASS] [loopback] {tuning}/windowed: memory between optimizer steps below {tuning}/ddp's" in stdout
    assert "collectives alone: all-gather + reduce-scatter = " in stdout  # the backend's price, measured


def test_every_configuration_reproduces_stock_exactly(quick_run):
    _, stdout, rows, _ = quick_run
    for tuning in grpo.TUNINGS:
        stock = rows[f"{tuning}/stock"]
        assert len(stock.logs[0]) == 1 + 1  # the untimed warm-up step and the timed one
        assert all("kl" in entry for entry in stock.logs[0])  # beta > 0: KL logged, and compared
        for name in (n for n in rows if n.startswith(tuning + "/")):
            for key in ("logs", "rewards", "completions"):
                assert getattr(rows[name], key) == getattr(stock, key), (name, key)
        assert f"[PASS] [loopback] {tuning}: completions, rewards, KL and losses identical to stock" in stdout


def test_timing_targets_are_not_decided_in_quick_mode(quick_run):
    _, stdout, _, _ = quick_run
    lines = [line for line in stdout.splitlines() if "faster per GRPO step" in line]
    assert len(lines) == 2, lines  # full and LoRA, over loopback
    # One round gives one ratio per configuration: no interval, so no PASS or FAIL either.
    assert all(line.strip().startswith("[N/D]") and "not decided at this size" in line for line in lines)
