"""recipes/plot_rewards.py, the last step of `make demo`: the one summary line (the accuracy
reward's mean over the first and the last 100 steps, and where the curve is) from a
trainer_state.json whose means are known, and the plot written beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "plot_rewards.py"


def write_state(path: Path, accuracy: dict[int, float]) -> Path:
    """A trainer_state.json as the Trainer writes it: one reward entry per logged step (format
    reward 1, so the total is accuracy + 1), and entries without rewards (the run's summary)."""
    history = [
        {"step": s, "reward": a + 1, "rewards/accuracy_reward/mean": a, "rewards/format_reward/mean": 1.0}
        for s, a in accuracy.items()
    ]
    path.write_text(json.dumps({"log_history": [*history, {"step": max(accuracy), "train_runtime": 1.0}]}))
    return path


def summarize(state: Path, png: Path) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(state), str(png)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 0
    (line,) = proc.stdout.splitlines()
    return line


def test_a_500_step_run_is_summed_up_over_its_first_and_last_100_steps(tmp_path):
    # Logged every 10 steps: steps 10..100 at 0.2, 110..400 at 0.4, 410..500 at 0.7 and 0.5.
    accuracy = {s: 0.2 if s <= 100 else 0.4 if s <= 400 else (0.7 if s % 20 else 0.5) for s in range(10, 501, 10)}
    png = tmp_path / "curve.png"
    line = summarize(write_state(tmp_path / "trainer_state.json", accuracy), png)
    assert line == (
        "accuracy reward (share of right answers): 0.20 over the first 100 steps -> 0.60 over the last 100 "
        f"(of 500); curve: {png}"
    )


def test_a_short_run_is_summed_up_over_its_halves(tmp_path):
    accuracy = {1: 0.0, 2: 0.5, 3: 1.0, 4: 1.0}  # first half (steps 1-2) 0.25, last half (3-4) 1.0
    png = tmp_path / "curve.png"
    line = summarize(write_state(tmp_path / "trainer_state.json", accuracy), png)
    assert line == (
        f"accuracy reward (share of right answers): 0.25 over the first 2 steps -> 1.00 over the last 2 (of 4); "
        f"curve: {png}"
    )


def test_the_wrong_arguments_say_what_to_pass():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 1 and "usage:" in proc.stderr and "trainer_state.json <plot.png>" in proc.stderr
