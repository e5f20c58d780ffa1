"""Where one profiled configuration's generation spends time that another's does not:
`python -m benchmarks.profile_diff BASE.prof OTHER.prof [--top N]`, two files `run --grpo --profile`
wrote (e.g. generation_full_ddp_r0.prof and generation_full_window_r0.prof). Prints each profile's
own time per generation call, then the functions whose own time (tottime) grew most from BASE to
OTHER, per generation call, with their call counts per generation. cProfile inflates Python code
against C++ kernels: read the shares, not the absolute figures.
"""

from __future__ import annotations

import argparse
import pstats

GENERATE = "_generate"
"""TRL's GRPOTrainer method the profile wraps: its calls are the generations profiled."""


def per_function(path: str) -> tuple[dict[str, tuple[float, int]], int]:
    """(own seconds, calls) by function, and how many generations the profile holds."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]  # pstats keeps its table there
    rows, generations = {}, 0
    for (file, line, name), (_, calls, own, _cumulative, _) in stats.items():
        where = f"{file.split('site-packages/')[-1]}:{line} {name}"
        rows[where] = (own, calls)
        if name == GENERATE and file.endswith("grpo_trainer.py"):
            generations = max(generations, calls)
    return rows, max(generations, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    base, n_base = per_function(args.base)
    other, n_other = per_function(args.other)
    for path, rows, n in ((args.base, base, n_base), (args.other, other, n_other)):
        total = sum(own for own, _ in rows.values())
        print(f"{path}: {n} generation(s), {total / n * 1e3:.0f} ms of own time per generation")
    print("\nown ms per generation, OTHER - BASE (calls per generation, OTHER - BASE):")
    diffs = []
    for where in base.keys() | other.keys():
        own_b, calls_b = base.get(where, (0.0, 0))
        own_o, calls_o = other.get(where, (0.0, 0))
        diffs.append((own_o / n_other - own_b / n_base, calls_o / n_other - calls_b / n_base, where))
    for ms, calls, where in sorted(diffs, reverse=True)[: args.top]:
        print(f"{ms * 1e3:+9.1f} ms  {calls:+8.0f} calls  {where}")


if __name__ == "__main__":
    main()
