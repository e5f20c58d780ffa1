"""Paired statistics both reports judge their targets on. Two configurations that ran in the same
round saw the same machine load, so a ratio per round cancels that load where a ratio of medians
does not; a target is then judged on the median of those ratios with a bootstrap interval
(`targets.Target.judge`).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable

from benchmarks.targets import SKIP, UNDECIDED, UNDECIDED_NOTE, Target, TargetResult, worst


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


def median_ci(values: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float, float]:
    """(median, low, high): a percentile bootstrap interval of the median, seeded so a report
    redrawn from the same JSON prints the same numbers."""
    rng, n = random.Random(0), len(values)
    boot = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return (
        statistics.median(values),
        boot[int(tail * resamples)],
        boot[min(int((1 - tail) * resamples), resamples - 1)],
    )


def judge(target: Target, values: list[float], quick: bool) -> tuple[str, tuple[float, float, float]]:
    """The target's status on these paired values, and their (median, low, high)."""
    stat = median_ci(values)
    return target.judge(*stat, n=len(values), quick=quick), stat


def noted(status: str, measured: str) -> str:
    """The measured figures, marked when the run was too small to decide on them."""
    return f"{UNDECIDED_NOTE}: {measured}" if status == UNDECIDED else measured


def verdict(what: str, statuses: list[str], notes: list[str], sep: str = "; ", skip: str = "not run") -> TargetResult:
    """A target judged in parts: the worst part's status and every part's notes (SKIP: no part)."""
    if not statuses:
        return TargetResult(what, SKIP, skip)
    status = worst(statuses)
    return TargetResult(what, status, noted(status, sep.join(notes)))


def fmt_ci(stat: tuple[float, float, float], n: int) -> str:
    return f"{stat[0]:.3f} (95% CI {stat[1]:.3f}-{stat[2]:.3f}, n={n})"


def fmt_count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"
