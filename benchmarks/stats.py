"""What both reports share: the paired statistics they judge targets on, the head and targets table
of a results.md, and the figure helpers (matplotlib imported only to draw). Two configurations in the
same round saw the same machine load, so a ratio per round cancels it where a ratio of medians does
not; a target is judged on the median of those ratios with a bootstrap interval.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable
from pathlib import Path

from benchmarks.records import ResultsBase
from benchmarks.targets import SKIP, UNDECIDED, UNDECIDED_NOTE, Target, TargetResult, worst

MiB = 2**20


def by_round(rounds: Iterable[int | None], values: Iterable[float]) -> dict[int, float]:
    """round -> value, for steps that ran in a round (a round's median where it ran several)."""
    grouped: dict[int, list[float]] = {}
    for r, v in zip(rounds, values, strict=True):
        if r is not None:
            grouped.setdefault(r, []).append(v)
    return {r: statistics.median(vs) for r, vs in grouped.items()}


def ratios(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """a / b in every round both ran in, in round order."""
    return [a[r] / b[r] for r in sorted(a.keys() & b.keys())]


def pooled(per_M: dict[int, list[float]]) -> list[float]:
    return [v for r in per_M.values() for v in r]


def median_ci(values: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float, float]:
    """(median, low, high): a percentile bootstrap interval of the median, seeded so a report
    redrawn from the same JSON prints the same numbers."""
    rng, n = random.Random(0), len(values)
    boot = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    high = boot[min(int((1 - tail) * resamples), resamples - 1)]
    return statistics.median(values), boot[int(tail * resamples)], high


def judge(target: Target, values: list[float], quick: bool) -> tuple[str, tuple[float, float, float]]:
    """The target's status on these paired values, and their (median, low, high)."""
    stat = median_ci(values)
    return target.judge(*stat, n=len(values), quick=quick), stat


def judged(what: str, target: Target, values: list[float], quick: bool, measured: str) -> TargetResult:
    """One target on paired values; `measured` may use {m}, {lo}, {hi} (the median and interval) and {n}."""
    status, (m, lo, hi) = judge(target, values, quick)
    return verdict(what, [status], [measured.format(m=m, lo=lo, hi=hi, n=len(values))])


def verdict(what: str, statuses: list[str], notes: list[str], sep: str = "; ", skip: str = "not run") -> TargetResult:
    """A target judged in parts: the worst part's status and every part's notes, marked when the run
    was too small to decide on them (SKIP: no part)."""
    if not statuses:
        return TargetResult(what, SKIP, skip)
    status = worst(statuses)
    return TargetResult(what, status, (f"{UNDECIDED_NOTE}: " if status == UNDECIDED else "") + sep.join(notes))


def fmt_ci(stat: tuple[float, float, float], n: int) -> str:
    return f"{stat[0]:.3f} (95% CI {stat[1]:.3f}-{stat[2]:.3f}, n={n})"


def fmt_count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def fmt_held(grad: int, handle: int | None) -> str:
    """Held gradient MiB, the plugin's own measure in brackets."""
    return f"{grad / MiB:.2f}" + (f" ({handle / MiB:.2f})" if handle is not None else "")


# -- results.md and the PNGs ------------------------------------------------------------------------
def header(title: str, results: ResultsBase) -> list[str]:
    """A results.md's title, command, wall time and machine."""
    m = results.machine
    machine = (
        f"{m.get('cpu_model', m.get('processor', '?'))}, {m.get('logical_cpus')} logical CPUs, "
        f"{m.get('memory_gib')} GiB RAM, {m.get('platform')}, device={m.get('device')}"
    )
    return [
        f"# {title}",
        "",
        f"Command: `{results.command}`  ",
        f"Wall time: {results.elapsed_s} s  ",
        f"Machine: {machine}  ",
        "",
    ]


def write_md(out: Path, parts: list[str], checked: list[TargetResult], images: dict[str, str]) -> None:
    """results.md: the tables, the targets table and the images (file -> alt text)."""
    lines = [*parts, "## Targets", "", "| target | result | measured |", "|---|---|---|"]
    lines += [f"| {r.target} | {r.status} | {r.measured} |" for r in checked]
    for name, alt in images.items():
        lines += ["", f"![{alt}]({name})"]
    (Path(out) / "results.md").write_text("\n".join([*lines, ""]))


def panels(n: int, width: float, height: float):
    """A figure of n panels side by side, and its axes."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and the benchmark machines have no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, axes: list, path: Path) -> None:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
