"""Plot the mean rewards of a recipes/grpo.py run from its trainer_state.json.

python recipes/plot_rewards.py runs/grpo/trainer_state.json docs/grpo_reward_curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

SERIES = {"reward": "total", "rewards/accuracy_reward/mean": "accuracy", "rewards/format_reward/mean": "format"}


def main(state_path: str, out_path: str) -> None:
    history = [e for e in json.loads(Path(state_path).read_text())["log_history"] if "reward" in e]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in SERIES.items():
        ax.plot([e["step"] for e in history], [e[key] for e in history], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title("recipes/grpo.py, embedded model, FSDP2 on 2 CPU processes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
