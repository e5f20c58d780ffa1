"""Plot the mean rewards of a recipes/grpo.py run from its trainer_state.json, and print one line:
the accuracy reward's mean over the run's first and last 100 steps, and where the plot is.

python recipes/plot_rewards.py runs/grpo/trainer_state.json runs/grpo/reward_curve.png

`make demo` runs it after the default run. The accuracy reward is 1 for a right answer, else 0,
so its mean is the share of right answers; each log entry is the mean over its logging interval
(`--logging_steps`), so with equal intervals the entries' mean is the steps' mean.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

SERIES = {"reward": "total", "rewards/accuracy_reward/mean": "accuracy", "rewards/format_reward/mean": "format"}
ACCURACY = "rewards/accuracy_reward/mean"
WINDOW = 100
"""Steps at each end of the run that the summary line averages over (docs/recipe.md quotes them)."""


def reward_history(state_path: str) -> list[dict]:
    """The log entries of `trainer_state.json` that carry rewards, in step order."""
    return [e for e in json.loads(Path(state_path).read_text())["log_history"] if "reward" in e]


def summary(history: list[dict], out_path: str) -> str:
    """One line: the accuracy reward's mean over the first and the last `WINDOW` steps (half the
    run each when it is shorter than twice that), and where the curve is."""
    key = ACCURACY if all(ACCURACY in e for e in history) else "reward"
    name = "accuracy reward (share of right answers)" if key == ACCURACY else "mean reward"
    if not history:
        return f"{name}: no reward logged; curve: {out_path}"
    last_step = history[-1]["step"]
    window = max(1, min(WINDOW, last_step // 2))
    first = [e[key] for e in history if e["step"] <= window] or [history[0][key]]
    last = [e[key] for e in history if e["step"] > last_step - window] or [history[-1][key]]
    return (
        f"{name}: {sum(first) / len(first):.2f} over the first {window} steps -> "
        f"{sum(last) / len(last):.2f} over the last {window} (of {last_step}); curve: {out_path}"
    )


def plot(history: list[dict], out_path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in SERIES.items():
        logged = [e for e in history if key in e]
        if logged:
            ax.plot([e["step"] for e in logged], [e[key] for e in logged], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title("recipes/grpo.py, embedded model, FSDP2 on 2 CPU processes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)


def main(state_path: str, out_path: str) -> None:
    history = reward_history(state_path)
    plot(history, out_path)
    print(summary(history, out_path))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python {sys.argv[0]} <output_dir>/trainer_state.json <plot.png>")
    main(sys.argv[1], sys.argv[2])
