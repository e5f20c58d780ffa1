"""What both reports share: the paired statistics they judge targets on (`per_round`, `paired`,
`judge`), and the one writer of a report (`write_report`: results.md's head, the benchmark's
tables, the targets table and the figures, drawn with the helpers here; matplotlib is imported only
to draw). Two configurations in the same round saw the same machine load, so a ratio per round
cancels it where a ratio of medians does not; a target is judged on the median of those ratios with
a bootstrap interval. `mlp_report.py` and `grpo_report.py` hold only their own tables, figures and
targets.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.records import ResultsBase, Row
from benchmarks.targets import SKIP, UNDECIDED, UNDECIDED_NOTE, Target, TargetResult, format_summary, worst

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


def per_round(row: Row, key: str = "step_times_s") -> dict[int, float]:
    """round -> a row's median step time (or the per-step list `key` names) in that round."""
    return by_round(row.step_rounds, getattr(row, key))


def paired(a: Row, b: Row, key: str = "step_times_s") -> list[float]:
    """a's step / b's step per round, in every round both ran in (the same load on both)."""
    return ratios(per_round(a, key), per_round(b, key))


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
def write_report(
    results: ResultsBase,
    out: Path,
    title: str,
    tables: list[str],
    checked: list[TargetResult],
    images: dict[str, str],
    draw: Callable[[Any, Path], None],
) -> str:
    """A benchmark's report in `out`: results.md (the title, command, wall time and machine, the
    tables, the targets and the images: file -> alt text), the images (`draw(results, out)` writes
    them), and the target summary it returns."""
    m = results.machine
    machine = (
        f"{m.get('cpu_model', m.get('processor', '?'))}, {m.get('logical_cpus')} logical CPUs, "
        f"{m.get('memory_gib')} GiB RAM, {m.get('platform')}, device={m.get('device')}"
    )
    lines = [f"# {title}", "", f"Command: `{results.command}`  ", f"Wall time: {results.elapsed_s} s  "]
    lines += [f"Machine: {machine}  ", "", *tables, "## Targets", "", "| target | result | measured |", "|---|---|---|"]
    lines += [f"| {r.target} | {r.status} | {r.measured} |" for r in checked]
    for name, alt in images.items():
        lines += ["", f"![{alt}]({name})"]
    (Path(out) / "results.md").write_text("\n".join([*lines, ""]))
    draw(results, Path(out))
    return format_summary(checked)


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
