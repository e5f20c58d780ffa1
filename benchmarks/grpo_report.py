"""The GRPO benchmark's results.json -> results.md (a table per network), grpo_step_split.png
(each configuration's step split into generation, log-prob passes, scoring and training), and the
target lines (PASS / FAIL / SKIP, in the style of report.py).

`python -m benchmarks.report DIR` redraws all of it from DIR/results.json.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks import grpo
from benchmarks.report import describe_machine, finish_axes, fmt_load, format_summary, plt, save_figure

MiB = 2**20
PHASES = ("generation", "logprob", "scoring", "training")
PHASE_LABELS = {"generation": "generation", "logprob": "log-prob passes (no grad)", "scoring": "scoring",
                "training": "training"}  # fmt: skip
COLORS = {"generation": "tab:orange", "logprob": "tab:purple", "scoring": "tab:gray", "training": "tab:blue"}
# The window's speedup over stock per GRPO step: over loopback, and per simulated link.
SPEEDUP_TARGETS = {None: 3.0, "1gbit": 5.0}
UNDECIDED = "not decided at this size"


def network(run: dict) -> str:
    return "loopback" if run["link"] is None else f"{run['link']} link, 2 hosts"


def rows_of(run: dict) -> dict[str, dict]:
    return {r["config"]: r for r in run["rows"]}


def round_medians(row: dict) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for r, t in zip(row["step_rounds"], row["step_times_s"]):
        by.setdefault(r, []).append(t)
    return {r: statistics.median(ts) for r, ts in by.items()}


def speedup(run: dict, config: str, base: str) -> tuple[float, list[float]] | None:
    """base's step / config's step: the median over rounds of the ratio of each round's medians
    (both ran in the same round, under the same load), and the per-round ratios."""
    rows = rows_of(run)
    if config not in rows or base not in rows:
        return None
    a, b = round_medians(rows[config]), round_medians(rows[base])
    ratios = [b[r] / a[r] for r in sorted(a.keys() & b.keys())]
    return (statistics.median(ratios), ratios) if ratios else None


def trained_gathers(row: dict) -> list[int]:
    """All-gathers of the trained model per step seen, generation and training together (the
    log-prob passes of a reference model are a model of their own)."""
    seen = row["counts_seen"]
    return sorted({g + t for g in seen["generation"]["all_gathers"] for t in seen["training"]["all_gathers"]})


# -- table --------------------------------------------------------------------------------------
def write_table(results: dict) -> str:
    lines = [f"Command: `{results['command']}`  ", f"Wall time: {results['elapsed_s']} s  ",
             f"Machine: {describe_machine(results['machine'])}  ",
             f"Load average (1/5/15 min) before: {fmt_load(results, 'before')}, after: {fmt_load(results, 'after')}  ",
             ""]  # fmt: skip
    for run in results["runs"]:
        f = run["facts"]
        units = sorted({r["units"] for r in run["rows"]})
        lines += [
            f"### {network(run)}: Qwen2 {f['params'] / 1e6:.2f} M params (hidden {f['hidden']}, {f['layers']} layers, "
            f"vocab {f['vocab']}), FSDP2 units U = {'/'.join(map(str, units))} (full/LoRA), 2 ranks, M = {f['M']}, "
            f"{f['batch']} completion per micro-batch, {f['generations']} per prompt, {f['completion']} tokens"
            + (f"; {run['link_bytes'] / MiB:.0f} MiB through the shaped NICs" if run.get("link_bytes") else ""),
            "",
            "Step ms: median wall time of an optimizer step (slowest rank). Speedup: stock's step / this step, per "
            "round, median over rounds. Phase ms: medians of the same steps. All-gathers per step on one rank in "
            "generation / log-prob passes / training; reduce-scatters and MiB sent (ring formula) over the whole "
            "step. Held: gradient and unsharded parameter bytes on one rank after a backward (the plugin's own "
            "held-gradient measure in brackets); RSS: the step's peak resident growth.",
            "",
            "| configuration | step ms | speedup | generation ms | log-prob ms | scoring ms | training ms | "
            "all-gathers gen / log-prob / train | reduce-scatters | MiB sent | held grad MiB | held params MiB | "
            "RSS growth MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = rows_of(run)
        for name in [n for n in grpo.CONFIGS if n in rows]:
            r = rows[name]
            tuning = name.split("/")[0]
            sp = speedup(run, name, f"{tuning}/stock")
            c, ph = r["counts_per_step"], r["phase_time_s"]
            held = f"{r['held_grad_bytes'] / MiB:.2f}"
            if r.get("handle_held_grad_bytes") is not None:
                held += f" ({r['handle_held_grad_bytes'] / MiB:.2f})"
            lines.append(
                f"| {name} | {r['step_time_s'] * 1e3:.0f} | {sp[0]:.2f}x | "
                + " | ".join(f"{ph[p] * 1e3:.0f}" for p in PHASES)
                + f" | {' / '.join(fmt(c[p]['all_gathers']) for p in ('generation', 'logprob', 'training'))} | "
                f"{fmt(sum(c[p]['reduce_scatters'] for p in PHASES))} | "
                f"{sum(c[p]['bytes_sent'] for p in PHASES) / MiB:.0f} | {held} | {r['held_param_bytes'] / MiB:.2f} | "
                f"{r['rss_growth_bytes'] / MiB:.0f} |"
            )
        for name, why in run["unavailable"].items():
            lines.append(f"| {name} | {why} |" + " |" * 11)
        lines.append("")
    lines += ["Configurations (each for full fine-tuning and for LoRA on q_proj, v_proj):", ""]
    lines += [f"- `{mode}`: {label}" for mode, label in grpo.LABELS.items()]
    return "\n".join(lines) + "\n"


def fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


# -- plot ---------------------------------------------------------------------------------------
def plot_step_split(results: dict, path: Path) -> None:
    """One panel per network: each configuration's median step as stacked phases."""
    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 5.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        rows = rows_of(run)
        names = [n for n in grpo.CONFIGS if n in rows]
        left = [0.0] * len(names)
        for phase in PHASES:
            widths = [rows[n]["phase_time_s"][phase] for n in names]
            if any(widths):
                ax.barh(names, widths, left=left, color=COLORS[phase], label=PHASE_LABELS[phase])
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("median GRPO step (s)")
        ax.set_title(f"{network(run)}: where a GRPO step goes")
        finish_axes(ax)
    save_figure(fig, path)


# -- targets ------------------------------------------------------------------------------------
def check_targets(results: dict) -> list[tuple[str, str, str]]:
    out = []
    quick = results["plan"].get("quick")
    for run in results["runs"]:
        where, rows = network(run), rows_of(run)
        target = SPEEDUP_TARGETS.get(run["link"])
        for tuning in grpo.TUNINGS:
            window, stock = f"{tuning}/window", f"{tuning}/stock"
            sp = speedup(run, window, stock)
            if target is not None:
                what = f"[{where}] {window} at least {target:g}x faster per GRPO step than {stock}"
                if sp is None:
                    out.append((what, "SKIP", "not run"))
                else:
                    measured = f"{sp[0]:.2f}x (per round: {', '.join(f'{x:.2f}x' for x in sp[1])})"
                    status = "SKIP" if quick else ("PASS" if sp[0] >= target else "FAIL")
                    out.append((what, status, f"{UNDECIDED}: {measured}" if quick else measured))
            if window in rows:
                out.append(check_window_gathers(where, rows[window]))
        out += check_identical(where, rows)
    return out


def check_window_gathers(where: str, row: dict) -> tuple[str, str, str]:
    """The window gathers each unit of the trained model once per step: at generation's first
    forward, kept through the decode steps and every micro-batch until the optimizer step."""
    U, seen = row["units"], row["counts_seen"]
    total = trained_gathers(row)
    what = f"[{where}] {row['config']}: the trained model's all-gathers per optimizer step = U exactly"
    detail = (f"U = {U}; every timed step: generation {seen['generation']['all_gathers']}, training "
              f"{seen['training']['all_gathers']} (reference log-prob passes, a model of their own: "
              f"{seen['logprob']['all_gathers']})")  # fmt: skip
    return what, "PASS" if total == [U] else "FAIL", detail


def check_identical(where: str, rows: dict) -> list[tuple[str, str, str]]:
    """Every configuration's completions (per-rank digests of the token ids), rewards (as
    computed, gathered over ranks) and logged losses and rewards equal stock's exactly, at every
    step of every round."""
    out = []
    for tuning in grpo.TUNINGS:
        stock = rows.get(f"{tuning}/stock")
        others = [n for n in grpo.CONFIGS if n.startswith(tuning + "/") and n in rows and n != f"{tuning}/stock"]
        what = f"[{where}] {tuning}: completions, rewards and losses identical to stock at every logged step (exact)"
        if stock is None or not others:
            out.append((what, "SKIP", "stock or no other configuration run"))
            continue
        ref = {"logs": stock["logs"][0], "rewards": stock["rewards"][0], "completions": stock["completions"][0]}
        bad, steps = [], len(ref["logs"])
        for name in others:
            for k, _ in enumerate(rows[name]["logs"]):
                got = {key: rows[name][key][k] for key in ref}
                diff = [key for key in ref if got[key] != ref[key]]
                if diff:
                    bad.append(f"{name} round {k}: {', '.join(diff)} differ{first_difference(got, ref)}")
        stock_rounds = all(stock[key][k] == ref[key] for key in ref for k in range(len(stock["logs"])))
        if not stock_rounds:
            bad.append("stock differs between its own rounds")
        out.append((what, "FAIL" if bad else "PASS", "; ".join(bad) if bad else
                    f"{', '.join(others)} vs stock: {steps} steps x {len(stock['logs'])} round(s), "
                    "losses and rewards logged, completions and rewards recorded"))  # fmt: skip
    return out


def first_difference(got: dict, ref: dict) -> str:
    for a, b in zip(got["logs"], ref["logs"]):
        for key in ("loss", "reward"):
            if a.get(key) != b.get(key):
                return f" (step {a.get('step')}: {key} {a.get(key)!r} vs stock {b.get(key)!r})"
    return ""


def write_report(results: dict, out: Path) -> str:
    """Write results.md and grpo_step_split.png into `out`; return the target summary."""
    out = Path(out)
    targets = check_targets(results)
    md = ["# GRPO benchmark results", "", write_table(results), "## Targets", "",
          "| target | result | measured |", "|---|---|---|"]  # fmt: skip
    md += [f"| {w} | {s} | {m} |" for w, s, m in targets]
    md += ["", "![GRPO step split](grpo_step_split.png)", ""]
    (out / "results.md").write_text("\n".join(md))
    plot_step_split(results, out / "grpo_step_split.png")
    return format_summary(targets)
