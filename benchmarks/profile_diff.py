"""Where one profiled configuration's GRPO step spends time that another's does not:
`python -m benchmarks.profile_diff BASE.prof OTHER.prof [--top N]`, two files `run --grpo --profile`
wrote (e.g. full_ddp_r0.prof and full_windowed_r0.prof: the timed steps of one round on rank 0).
Steps are counted by TRL's `_generate` calls (the benchmark generates once per optimizer step).
Prints each profile's own time and generation's time per step, then the functions whose own time
(tottime) grew most from BASE to OTHER, per step, with their calls per step. cProfile inflates
Python code against C++ kernels: read the shares, not the absolute figures.
"""

from __future__ import annotations

import argparse
import pstats

GENERATE = "_generate"
"""TRL's GRPOTrainer method that generates: one call per optimizer step in the benchmark."""


def per_function(path: str) -> tuple[dict[str, tuple[float, int]], int, float]:
    """(own seconds, calls) by function, how many steps the profile holds, and generation's seconds."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]  # pstats keeps its table there
    rows, steps, generation = {}, 0, 0.0
    for (file, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{file.split('site-packages/')[-1]}:{line} {name}"
        rows[where] = (own, calls)
        if name == GENERATE and file.endswith("grpo_trainer.py"):
            steps, generation = max(steps, calls), max(generation, cumulative)
    return rows, max(steps, 1), generation


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    base, n_base, gen_base = per_function(args.base)
    other, n_other, gen_other = per_function(args.other)
    for path, rows, n, gen in ((args.base, base, n_base, gen_base), (args.other, other, n_other, gen_other)):
        total = sum(own for own, _ in rows.values())
        print(f"{path}: {n} step(s), per step {total / n * 1e3:.0f} ms of own time, generation {gen / n * 1e3:.0f} ms")
    print("\nown ms per step, OTHER - BASE (calls per step, OTHER - BASE):")
    diffs = []
    for where in base.keys() | other.keys():
        own_b, calls_b = base.get(where, (0.0, 0))
        own_o, calls_o = other.get(where, (0.0, 0))
        diffs.append((own_o / n_other - own_b / n_base, calls_o / n_other - calls_b / n_base, where))
    for ms, calls, where in sorted(diffs, reverse=True)[: args.top]:
        print(f"{ms * 1e3:+9.1f} ms  {calls:+8.0f} calls  {where}")


if __name__ == "__main__":
    main()
