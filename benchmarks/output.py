"""What both reports write besides their own tables: the header of a results.md, its targets
table, and the matplotlib set-up and figure helpers of the PNGs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI and the benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.records import ResultsBase  # noqa: E402
from benchmarks.targets import TargetResult  # noqa: E402

MiB = 2**20


def header(results: ResultsBase) -> list[str]:
    """The lines every results.md starts with: command, wall time, machine."""
    return [f"Command: `{results.command}`  ", f"Wall time: {results.elapsed_s} s  ",
            f"Machine: {format_machine(results.machine)}  ", ""]  # fmt: skip


def format_machine(m: dict) -> str:
    """One line for `run.machine_facts`: CPU model, CPUs, memory, platform, device."""
    return (
        f"{m.get('cpu_model', m.get('processor', '?'))}, {m.get('logical_cpus')} logical CPUs, "
        f"{m.get('memory_gib')} GiB RAM, {m.get('platform')}, device={m.get('device')}"
    )


def targets_table(checked: list[TargetResult]) -> list[str]:
    """The "Targets" section of a results.md."""
    lines = ["## Targets", "", "| target | result | measured |", "|---|---|---|"]
    return lines + [f"| {r.target} | {r.status} | {r.measured} |" for r in checked]


def panels(n: int, width: float, height: float):
    """A figure of n panels side by side, and its axes."""
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def finish_axes(ax) -> None:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
