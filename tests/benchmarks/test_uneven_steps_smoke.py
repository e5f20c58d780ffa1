"""Smoke test of the uneven-steps benchmark: `python -m benchmarks.uneven_steps --quick` end to end
(2 gloo ranks, FSDP2, a tiny token model, 2 rounds; about 10 s). It checks the report's fields and
the exact token counts; it never asserts on timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.uneven_steps import STRATEGIES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven_steps")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.uneven_steps", "--quick", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "| token_budget |" in (out / "results.md").read_text()
    return json.loads((out / "results.json").read_text())


def test_report_fields(result):
    assert set(result["strategies"]) == set(STRATEGIES)
    for s in result["strategies"].values():
        assert s["tokens_per_s"] > 0 and s["tokens_per_cpu_s"] > 0 and s["micro_batches_per_rank"] >= 1
    assert set(result["ratios"]) == set(STRATEGIES[1:])
    for r in result["ratios"].values():
        assert len(r["per_round"]) == result["sizes"]["rounds"] and r["met"] in ("yes", "no", "undecided")
        assert r["ci95"][0] <= r["median"] <= r["ci95"][1] and r["tokens_run"] >= 1.0
    assert len(result["rows"]) == len(STRATEGIES) * result["sizes"]["rounds"]


def test_token_budget_runs_no_padding_and_windowed_replays_nothing(result):
    rows = result["rows"]
    for row in rows:
        if row["strategy"] in ("token_budget", "pad_resplit"):
            assert row["padding_tokens"] == 0 and row["dummy_micro_batches"] == 0, row
        assert row["processed_tokens"] == row["real_tokens"] + row["padding_tokens"]
    assert result["strategies"]["token_budget"]["padding_fraction"] == 0
    assert result["strategies"]["fixed"]["padding_fraction"] > 0
    # Every strategy of a round trains the same rollouts.
    for k in range(result["sizes"]["rounds"]):
        assert len({r["real_tokens"] for r in rows if r["round"] == k}) == 1
    # Every unit windowed makes uneven counts free: step(n) replayed nothing on either rank, and
    # evened some (the quick run's counts differ across ranks in some round).
    for stats in result["stats"]:
        assert stats["units_windowed"] == stats["units"] and stats["replayed_micro_batches"] == 0, stats
    assert sum(stats["evened_micro_batches"] for stats in result["stats"]) > 0
