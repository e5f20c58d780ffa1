"""Token-budget micro-batching with `grad_sync.step(n)` against padding, on skewed lengths:
`python -m benchmarks.uneven_steps [--quick] [--out DIR]`.

Each round, every rank draws its own rollouts (lognormal lengths, cut to 16..max_len) and runs one
optimizer step of each strategy on them, deferred with keep_params_unsharded (every unit windowed)
on FSDP2 (`uneven_steps_worker.py`):
- `token_budget`: packed by a token budget, each rank its own count, in `grad_sync.step(n)`;
- `pad_resplit`: the same packing's largest count over ranks, and each rank re-splits its sequences
  into that many token-balanced micro-batches (verl's `same_micro_num_in_dp`);
- `pad_dummy`: the same packing, a rank below the largest count running its last micro-batch again
  x 0 up to it (what `step(n)` replays under a plan whose counts are not free);
- `fixed`: `--fixed` sequences per micro-batch, each padded to its micro-batch's longest.
Writes results.json and results.md to `--out`, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.stats import median_ci
from testbed.launch import REPO, fsdp2_config, launch

STRATEGIES = ("token_budget", "pad_resplit", "pad_dummy", "fixed")
WORKER = Path(__file__).with_name("uneven_steps_worker.py")
TARGET = 1.3  # token_budget's real tokens per second over padding's, what step(n) aims for
# The length distribution, fixed before any run from what RL rollouts look like (a median of a few
# hundred tokens, a long right tail, a few percent cut at the generation limit), and the model.
FULL = dict(rounds=32, seqs=16, median=256, sigma=1.0, max_len=2048, budget=2048, fixed=4, vocab=512, dim=128, layers=4)
QUICK = {**FULL, "rounds": 2, "seqs": 6, "vocab": 64, "dim": 32, "layers": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds (smoke test)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "uneven_steps"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned (default: one core per rank)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), help=f"default {value} (--quick: {QUICK[key]})")
    return p.parse_args(argv)


def merge(ranks: list[dict]) -> list[dict]:
    """One row per (round, strategy): the step's slowest rank's time, the rest summed over ranks."""
    rows = []
    for per_rank in zip(*(r["steps"] for r in ranks), strict=True):
        first = per_rank[0]
        assert all((s["round"], s["strategy"]) == (first["round"], first["strategy"]) for s in per_rank)
        row = {"round": first["round"], "strategy": first["strategy"], "time_s": max(s["time_s"] for s in per_rank)}
        for key in ("cpu_s", "real_tokens", "processed_tokens", "padding_tokens", "dummy_micro_batches"):
            row[key] = sum(s[key] for s in per_rank)
        row["micro_batches"] = [s["micro_batches"] for s in per_rank]
        row["tokens_per_s"] = row["real_tokens"] / row["time_s"]
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per strategy: medians over rounds and padding's share; per other strategy: token_budget's
    ratios per round (the same rollouts, the same load), their median, 95% CI and range."""
    by = {s: {r["round"]: r for r in rows if r["strategy"] == s} for s in STRATEGIES}
    out: dict = {"strategies": {}, "ratios": {}}
    for s, rounds in by.items():
        steps = list(rounds.values())
        out["strategies"][s] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
            "tokens_per_cpu_s": statistics.median(r["real_tokens"] / r["cpu_s"] for r in steps),
            "step_time_s": statistics.median(r["time_s"] for r in steps),
            "micro_batches_per_rank": statistics.mean(n for r in steps for n in r["micro_batches"]),
            "padding_fraction": sum(r["padding_tokens"] for r in steps) / sum(r["processed_tokens"] for r in steps),
            "dummy_micro_batches": sum(r["dummy_micro_batches"] for r in steps),
        }
    a = by["token_budget"]
    for s in STRATEGIES[1:]:
        pairs = [(a[k], by[s][k]) for k in sorted(a.keys() & by[s].keys())]
        wall = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in pairs]
        m, lo, hi = median_ci(wall)
        out["ratios"][s] = {
            "per_round": wall,
            "median": m,
            "ci95": [lo, hi],
            "range": [min(wall), max(wall)],
            "cpu": statistics.median(y["cpu_s"] / x["cpu_s"] for x, y in pairs),
            "tokens_run": sum(y["processed_tokens"] for _, y in pairs) / sum(x["processed_tokens"] for x, _ in pairs),
            "met": "yes" if lo >= TARGET else "no" if hi < TARGET else "undecided",
        }
    return out


def markdown(summary: dict, command: str) -> str:
    lines = [f"`{command}`", "", "| strategy | real tokens/s | real tokens/CPU-s | step s | micro-batches/rank |"]
    lines[-1] += " padding, share of tokens run |\n|---|---|---|---|---|---|"
    for s, v in summary["strategies"].items():
        lines.append(
            f"| {s} | {v['tokens_per_s']:.0f} | {v['tokens_per_cpu_s']:.0f} | {v['step_time_s']:.3f} | "
            f"{v['micro_batches_per_rank']:.2f} | {v['padding_fraction']:.1%} ({v['dummy_micro_batches']} dummy mb) |"
        )
    lines += ["", "| token_budget over | real tokens/s, paired median (95% CI) | range | CPU time | tokens run |"]
    lines[-1] += f" >= {TARGET}x |\n|---|---|---|---|---|---|"
    for s, v in summary["ratios"].items():
        lines.append(
            f"| {s} | {v['median']:.3f} ({v['ci95'][0]:.3f}-{v['ci95'][1]:.3f}, n={len(v['per_round'])}) | "
            f"{v['range'][0]:.3f}-{v['range'][1]:.3f} | {v['cpu']:.3f} | {v['tokens_run']:.3f} | {v['met']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    preset = QUICK if args.quick else FULL
    sizes = {k: preset[k] if getattr(args, k) is None else getattr(args, k) for k in FULL}
    worker = [f"--{k.replace('_', '-')}={v}" for k, v in {**sizes, "seed": args.seed}.items()]
    worker += [] if args.no_pin else ["--pin-cores"]
    ranks = launch(WORKER, worker, fsdp2_config("Block", 2), timeout=900).check("uneven_steps' workers", 2)
    command = " ".join(["python -m benchmarks.uneven_steps", *(sys.argv[1:] if argv is None else argv)])
    rows, first = merge(ranks), ranks[0]
    summary = summarize(rows)
    facts = {"params": first["params"], "versions": first["versions"], "stats": [r["stats"] for r in ranks]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "sizes": sizes, "seed": args.seed, **facts, **summary, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(summary, command))
    print(markdown(summary, command))


if __name__ == "__main__":
    main()
