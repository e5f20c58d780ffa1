"""The MLP benchmark's report: results.json -> results.md (tables), the PNGs and the target
summary (PASS / FAIL / SKIP / N/D per target of `targets.py`, with the measured ratios). Over
loopback: step_time_vs_M.png and memory_vs_time.png; on the simulated cluster (runs carrying a
`link`): the same tables and targets per link, the margins a link decides, speedup_vs_link.png.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from benchmarks import mlp, targets
from benchmarks.cluster import link_bits_per_s
from benchmarks.output import MiB, finish_axes, header, panels, plt, save_figure, targets_table
from benchmarks.records import ConfigResult, Results, Run
from benchmarks.stats import by_round, fmt_ci, fmt_count, judge, noted, ratios, verdict
from benchmarks.targets import FAIL, PASS, SKIP, UNDECIDED, TargetResult


def index(run: Run) -> dict[tuple[str, int], ConfigResult]:
    return {(r.config, r.M): r for r in run.rows}


def times_by_round(row: ConfigResult, key: str = "step_times_s") -> dict[int, float]:
    return by_round(row.step_rounds, getattr(row, key))


def paired_ratios(run: Run, a: str, b: str, Ms: list[int], key: str = "step_times_s") -> dict[int, list[float]]:
    """M -> [a's step / b's step, one per round in which both ran]."""
    by, out = index(run), {}
    for M in Ms:
        if (a, M) in by and (b, M) in by and (paired := ratios(times_by_round(by[(a, M)], key),
                                                                 times_by_round(by[(b, M)], key))):  # fmt: skip
            out[M] = paired
    return out


def baseline_of(run: Run) -> str:
    """The per-micro-batch configuration ratios are taken against, in this run."""
    return "hsdp_per_micro_batch" if run.ranks == 4 else "per_micro_batch"


# -- table ------------------------------------------------------------------------------------
def write_table(results: Results) -> str:
    lines = header(results)
    for run in results.runs:
        f, by = run.facts, index(run)
        base = baseline_of(run)
        mem_col = "device peak MiB" if run.device != "cpu" else "RSS growth in step MiB"
        lines += [
            f"### {run.size} model: {f['params'] / 1e6:.2f} M params, U = {f['units']} units, "
            f"{run.ranks} ranks{' (2x2 HSDP mesh)' if run.ranks == 4 else ''}, {run.device}",
            "",
            f"Step ms: median wall time of an optimizer step (slowest rank). Ratios are step time / "
            f"`{base}` step time at the same M (< 1 is faster). CPU ms: median CPU time of the busiest "
            "rank in the step, less sensitive to other processes on the machine. Counts are per "
            "optimizer step on one rank; MiB sent per rank uses the ring formula on the tensors the "
            "collectives were given. Held grad: sharded + unsharded gradient bytes on one rank "
            "between micro-batches, from the tensors (plugin's own measure in brackets). Held params: "
            "unsharded parameter bytes alive after a backward (what a window keeps).",
            "",
            f"| configuration | M | step ms | ratio | CPU ms | reduce-scatters | all-reduces | all-gathers | "
            f"MiB sent | held grad MiB | held params MiB | {mem_col} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in ordered_configs(run):
            for M in sorted({m for (c, m) in by if c == name}):
                r = by[(name, M)]
                ratio = r.step_time_s / by[(base, M)].step_time_s if (base, M) in by else math.nan
                held = f"{r.held_grad_bytes / MiB:.2f}"
                if r.handle_held_grad_bytes is not None:
                    held += f" ({r.handle_held_grad_bytes / MiB:.2f})"
                mem = r.device_peak_bytes if run.device != "cpu" else r.rss_growth_bytes
                lines.append(
                    f"| {name} | {M} | {r.step_time_s * 1e3:.1f} | {ratio:.3f} | {r.step_cpu_s * 1e3:.0f} | "
                    f"{fmt_count(r.reduce_scatters_per_step)} | {fmt_count(r.all_reduces_per_step)} | "
                    f"{fmt_count(r.all_gathers_per_step)} | {r.bytes_sent_per_step / MiB:.1f} | {held} | "
                    f"{r.held_param_bytes / MiB:.2f} | {(mem or 0) / MiB:.0f} |"
                )
        lines.append("")
    lines += ["Configurations:", ""]
    lines += [f"- `{n}`: {c['label']}" for n, c in mlp.CONFIGS.items()]
    return "\n".join(lines) + "\n"


def ordered_configs(run: Run) -> list[str]:
    present = {r.config for r in run.rows}
    return [n for n in mlp.CONFIGS if n in present]


# -- plots ------------------------------------------------------------------------------------
def plot_step_times(results: Results, path: Path) -> None:
    runs = results.runs
    fig, axes = panels(len(runs), 6, 4.5)
    for ax, run in zip(axes, runs, strict=True):
        by = index(run)
        for name in ordered_configs(run):
            Ms = sorted(m for (c, m) in by if c == name)
            style = "--" if mlp.CONFIGS[name]["group"] == "peer" else "-"  # peers dashed
            ax.plot(Ms, [by[(name, m)].step_time_s * 1e3 for m in Ms], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(results.plan["Ms"], [str(m) for m in results.plan["Ms"]])
        ax.set_xlabel("micro-batches per optimizer step (M)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{run.size} ({run.facts['params'] / 1e6:.1f} M params, {run.ranks} ranks)")
        finish_axes(ax)
    save_figure(fig, path)


def step_cost_ratios(run: Run) -> list[float]:
    """What one byte of reduce-scatter cost in this run's steps against one byte of all-gather,
    FSDP's copies in and out included, per round at the largest M: the time deferral saved per
    reduce-scatter byte it removed, over the time the window then saved per all-gather byte it
    removed. The benchmark's units are all the same size, so per collective is per byte."""
    by = index(run)
    M = max((m for (name, m) in by if name == "window"), default=None)
    if M is None or not all((n, M) in by for n in ("per_micro_batch", "deferred")):
        return []
    pmb, deferred, window = (by[(n, M)] for n in ("per_micro_batch", "deferred", "window"))
    rs_removed = pmb.reduce_scatters_per_step - deferred.reduce_scatters_per_step
    ag_removed = deferred.all_gathers_per_step - window.all_gathers_per_step
    if rs_removed <= 0 or ag_removed <= 0:
        return []
    t0, t1, t2 = times_by_round(pmb), times_by_round(deferred), times_by_round(window)
    out = []
    for r in sorted(t0.keys() & t1.keys() & t2.keys()):
        per_rs, per_ag = (t0[r] - t1[r]) / rs_removed, (t1[r] - t2[r]) / ag_removed
        if per_ag > 0:
            out.append(per_rs / per_ag)
    return out


def held_bytes(row: ConfigResult) -> int:
    """What a configuration holds per rank between micro-batches: gradients and unsharded params."""
    return row.held_grad_bytes + row.held_param_bytes


def plot_frontier(results: Results, path: Path) -> None:
    """Held memory (gradients + unsharded params) vs step time at the largest M: per-micro-batch,
    deferred and the window are the corners of the frontier; every other configuration is a point."""
    runs = results.runs
    fig, axes = panels(len(runs), 6, 4.5)
    for ax, run in zip(axes, runs, strict=True):
        by, M = index(run), max(results.plan["Ms"])
        hsdp = run.ranks == 4
        corners = [baseline_of(run), "hsdp_deferred" if hsdp else "deferred"] + ([] if hsdp else ["window"])
        corners = [c for c in corners if (c, M) in by]
        if len(corners) >= 2:
            xs = [held_bytes(by[(c, M)]) / MiB for c in corners]
            ys = [by[(c, M)].step_time_s * 1e3 for c in corners]
            ax.plot(xs, ys, "k-", alpha=0.4, label=" - ".join(corners) + " frontier")
        for name in ordered_configs(run):
            if (name, M) not in by:
                continue
            r = by[(name, M)]
            marker = "s" if name.startswith("budget") else ("^" if mlp.CONFIGS[name]["group"] == "peer" else "o")
            ax.scatter(held_bytes(r) / MiB, r.step_time_s * 1e3, marker=marker, s=50, label=name)
        ax.set_xlabel("MiB held per rank between micro-batches (gradients + unsharded params)")
        ax.set_ylabel(f"median step time at M={M} (ms)")
        ax.set_title(f"{run.size}, {run.ranks} ranks: memory / time trade-off")
        finish_axes(ax)
    save_figure(fig, path)


# -- targets ----------------------------------------------------------------------------------
# The overhead pairs of `mlp.PAIRS`, the smallest M each is compared from (M = 1 has nothing
# to defer) and the target's line.
OVERHEADS = (
    ("deferred", "raw_fsdp2", 2, "deferred (plugin) within 2% of the hand-written raw-API loop"),
    ("per_micro_batch", "stock_sync_each_batch", 1, "per-micro-batch (plugin) within 2% of stock sync_each_batch=True"),
    ("window", "raw_window", 2, "window (plugin) within 2% of the hand-written window loop"),
    (
        "window",
        "stock_window_by_hand",
        2,
        "window (plugin) within 2% of the same flags by hand in accelerate's own loop",
    ),
)
# Exact collective counts per optimizer step: (reduce-scatters, all-reduces) as functions of M and
# U. HSDP also all-reduces across replicas on every reduce-scatter it does not defer.
EXPECTED_COUNTS = {
    "per_micro_batch": lambda M, U: (M * U, 0),
    "stock_sync_each_batch": lambda M, U: (M * U, 0),
    "deferred": lambda M, U: (U, 0),
    "stock_accumulate": lambda M, U: (U, 0),
    "raw_fsdp2": lambda M, U: (U, 0),
    "window": lambda M, U: (U, 0),
    "raw_window": lambda M, U: (U, 0),
    "stock_window_by_hand": lambda M, U: (U, 0),
    "stock_no_reshard": lambda M, U: (U, 0),
    "hsdp_per_micro_batch": lambda M, U: (M * U, M * U),
    "hsdp_deferred": lambda M, U: (U, U),
    "hsdp_defer_all_reduce": lambda M, U: (M * U, U),
}
WINDOWED = ("window", "raw_window", "stock_window_by_hand")


def check_targets(results: Results, link_decides_only: bool = False) -> list[TargetResult]:
    """Every target of `targets.py` on this run. `link_decides_only` (a simulated-cluster link):
    leave out the wrapper-overhead, frontier and run-time targets, which the loopback run decides."""
    quick = bool(results.plan.get("quick"))
    runs = [r for r in results.runs if r.ranks == 2]
    hsdp = [r for r in results.runs if r.ranks == 4]
    Ms = results.plan["Ms"]
    out: list[TargetResult] = []
    if not link_decides_only:
        for a, b, m_min, what in OVERHEADS:
            out += check_overhead(runs, a, b, [M for M in Ms if m_min <= M], what, quick)
        out += check_planner_cost(runs, quick)
    out.append(check_counts(runs + hsdp))
    out.append(check_window_gathers(runs))
    comm = [r for r in runs if r.size == "large"] or runs[-1:]  # the communication-bound model
    out += [check_deferred_speedup(run, quick) for run in comm]
    out += [check_window_speedup(run, quick) for run in comm]
    if not link_decides_only:
        out.append(check_frontier(results, runs))
    out.append(check_hsdp(results, hsdp))
    if not link_decides_only:
        out.append(check_run_time(results))
    return out


def check_overhead(runs: list[Run], a: str, b: str, Ms: list[int], what: str, quick: bool) -> list[TargetResult]:
    """a's step / b's step, paired by round and pooled over M, per model: the median must be
    within the tolerance on every model; and the sync choice's own cost, from the microbenchmark."""
    notes, statuses = [], []
    for run in runs:
        per_M = paired_ratios(run, a, b, Ms)
        if not per_M:
            continue
        pooled = [v for r in per_M.values() for v in r]
        status, stat = judge(targets.WRAPPER_OVERHEAD, pooled, quick)
        statuses.append(status)
        cpu = [v for r in paired_ratios(run, a, b, list(per_M), "step_cpus_s").values() for v in r]
        notes.append(
            f"{run.size}: paired median {fmt_ci(stat, len(pooled))}; per M "
            + ", ".join(f"M={m} {statistics.median(r):.3f}" for m, r in per_M.items())
            + (f"; CPU time {statistics.median(cpu):.3f}" if cpu else "")
        )
    if not statuses:
        return [TargetResult(what, SKIP, f"{a} or {b} not run")]
    out = [verdict(what, statuses, notes)]
    share = sync_control_overhead(runs, a, b)
    if share:
        worst_share = max(v for v, _ in share)
        out.append(
            TargetResult(
                f"{a}: {targets.SYNC_CONTROL.name}, against {b} (microbenchmark)",
                PASS if targets.SYNC_CONTROL.passes(worst_share) else FAIL,
                "; ".join(n for _, n in share),
            )
        )
    return out


def sync_control_overhead(runs: list[Run], a: str, b: str) -> list[tuple[float, str]]:
    """The wrapper's own cost, from the sync-control microbenchmark: (a's - b's microseconds per
    micro-batch) x M as a fraction of b's step at the largest M. Noise-robust where the step
    times are not."""
    notes = []
    for run in runs:
        by = index(run)
        M = max((m for (c, m) in by if c == b), default=None)
        if M is None or (a, M) not in by:
            continue
        ua, ub = by[(a, M)].sync_control_us, by[(b, M)].sync_control_us
        if not ua or not ub:
            continue
        share = (ua - ub) * M * 1e-6 / by[(b, M)].step_time_s
        notes.append(
            (share, f"{run.size}: {ua:.0f} vs {ub:.0f} us per micro-batch = {share:+.3%} of the step at M={M}")
        )
    return notes


def check_planner_cost(runs: list[Run], quick: bool) -> list[TargetResult]:
    """The budget planner weighs a reduce-scatter byte by a figure per backend: hold it against
    what this run's steps paid per byte of each, per round, from the corners at the largest M."""
    notes, statuses = [], []
    for run in runs:
        measured = step_cost_ratios(run)
        if not measured:
            continue
        planner = run.facts["planner_reduce_scatter_cost"]
        status, stat = judge(targets.PLANNER_COST, [m / planner for m in measured], quick)
        statuses.append(status)
        notes.append(
            f"{run.size}: a reduce-scatter byte cost {statistics.median(measured):.2f} all-gather bytes in the steps "
            f"(deferral's and the window's savings; measured / planner {fmt_ci(stat, len(measured))}), "
            f"planner {planner:g}"
        )
    return [verdict(targets.PLANNER_COST.name, statuses, notes)] if statuses else []


def check_counts(runs: list[Run]) -> TargetResult:
    """Every timed step's (reduce-scatters, all-reduces) against the configuration's formula."""
    bad, seen = [], 0
    for run in runs:
        U = run.facts["units"]
        for (name, M), r in index(run).items():
            if name not in EXPECTED_COUNTS:
                continue
            seen += 1
            got = (r.counts_seen_per_step["reduce_scatters"], r.counts_seen_per_step["all_reduces"])
            want = tuple([x] for x in EXPECTED_COUNTS[name](M, U))
            if got != want:
                bad.append(f"{run.size}/{name}/M={M}: (reduce-scatters, all-reduces) {got} != {want}")
    status = SKIP if not seen else (FAIL if bad else PASS)
    measured = "; ".join(bad) if bad else f"{seen} (configuration, M) segments, every timed step exact"
    return TargetResult(targets.COLLECTIVE_COUNTS.name, status, measured)


def check_window_gathers(runs: list[Run]) -> TargetResult:
    """The window's point: one all-gather per unit per optimizer step, whatever M is."""
    gathers, windows = [], 0
    for run in runs:
        for (name, M), r in index(run).items():
            if name in WINDOWED:
                windows += 1
                if r.counts_seen_per_step["all_gathers"] != [run.facts["units"]]:
                    gathers.append(f"{run.size}/{name}/M={M}: {r.counts_seen_per_step['all_gathers']}")
    status = SKIP if not windows else (FAIL if gathers else PASS)
    measured = "; ".join(gathers) if gathers else f"{windows} (configuration, M) segments, every timed step exact"
    return TargetResult(targets.WINDOW_GATHERS.name, status, measured)


def check_deferred_speedup(run: Run, quick: bool) -> TargetResult:
    """Per-micro-batch step / deferred step, paired by round, at M = 4 and at M = 8: each must
    show the clear margin."""
    what = f"{targets.DEFERRED_SPEEDUP.name} ({run.size})"
    per_M = paired_ratios(run, "per_micro_batch", "deferred", [4, 8])
    if not per_M:
        return TargetResult(what, SKIP, "not run")
    notes, statuses = [], []
    for M, speedups in per_M.items():
        status, stat = judge(targets.DEFERRED_SPEEDUP, speedups, quick)
        statuses.append(status)
        notes.append(f"M={M}: {stat[0]:.2f}x faster (paired, 95% CI {stat[1]:.2f}-{stat[2]:.2f}, n={len(speedups)})")
    notes[-1] += f" (clear margin: >= {targets.CLEAR_MARGIN}x)"
    return verdict(what, statuses, notes, sep=", ")


def check_window_speedup(run: Run, quick: bool) -> TargetResult:
    what = f"{targets.WINDOW_SPEEDUP.name} ({run.size})"
    per_M = paired_ratios(run, "per_micro_batch", "window", [8])
    if not per_M:
        return TargetResult(what, SKIP, "not run")
    status, stat = judge(targets.WINDOW_SPEEDUP, per_M[8], quick)
    measured = f"{stat[0]:.2f}x faster (paired, 95% CI {stat[1]:.2f}-{stat[2]:.2f}, n={len(per_M[8])})"
    return TargetResult(what, status, noted(status, measured))


def check_frontier(results: Results, runs: list[Run]) -> TargetResult:
    """Each budget point against the frontier at its held bytes (gradients + params): the line
    per-micro-batch -> deferred up to full deferral's bytes, then deferred -> window. Per round,
    (point - frontier) / per-micro-batch step, the frontier drawn from the same round's corners;
    the median over rounds and every M >= 2 must be at most the slack."""
    what = f"{targets.FRONTIER.name} (memory vs time, paired by round, M >= 2)"
    quick = bool(results.plan.get("quick"))
    notes, statuses = [], []
    corners = ("per_micro_batch", "deferred", "window")
    for run in runs:
        by = index(run)
        for name in [n for n in ordered_configs(run) if n.startswith("budget")]:
            excess: list[float] = []
            per_M: dict[int, list[float]] = {}
            for M in [m for m in results.plan["Ms"] if m >= 2]:
                if not all((c, M) in by for c in (*corners, name)):
                    continue
                (h0, h1, h2, h) = [held_bytes(by[(c, M)]) for c in (*corners, name)]
                (t0, t1, t2, t) = [times_by_round(by[(c, M)]) for c in (*corners, name)]
                # Which segment the point's held bytes fall in, and how far along it.
                (ha, ta), (hb, tb) = ((h0, t0), (h1, t1)) if h <= h1 else ((h1, t1), (h2, t2))
                where = min(max((h - ha) / (hb - ha), 0), 1) if hb != ha else 0.0
                rounds = sorted(t0.keys() & t1.keys() & t2.keys() & t.keys())
                per_M[M] = [(t[r] - (ta[r] + (tb[r] - ta[r]) * where)) / t0[r] for r in rounds]
                excess += per_M[M]
            if not excess:
                continue
            status, stat = judge(targets.FRONTIER, excess, quick)
            statuses.append(status)
            held = held_bytes(by[(name, max(per_M))]) / MiB
            place = {PASS: "on/inside", FAIL: "outside", UNDECIDED: "undecided"}[status]
            notes.append(
                f"{run.size}/{name} holding {held:.1f} MiB: {stat[0]:+.1%} of a per-micro-batch step from the "
                f"frontier (95% CI {stat[1]:+.1%} to {stat[2]:+.1%}, n={len(excess)}; per M "
                + ", ".join(f"M={m} {statistics.median(v):+.1%}" for m, v in per_M.items() if v)
                + f") -> {place}"
            )
    return verdict(what, statuses, notes)


def check_hsdp(results: Results, hsdp: list[Run]) -> TargetResult:
    """All-reduce deferral / per-micro-batch step, paired by round and pooled over M >= 2: the
    median must be below 1, and the held gradient bytes no more at any M."""
    what = targets.HSDP_SPEEDUP.name
    a, b = "hsdp_defer_all_reduce", "hsdp_per_micro_batch"
    for run in hsdp:
        by = index(run)
        per_M = paired_ratios(run, a, b, [M for M in results.plan["Ms"] if M >= 2])
        if not per_M:
            continue
        pooled = [v for r in per_M.values() for v in r]
        status, stat = judge(targets.HSDP_SPEEDUP, pooled, bool(results.plan.get("quick")))
        if not all(by[(a, M)].held_grad_bytes <= by[(b, M)].held_grad_bytes for M in per_M):
            status = FAIL
        notes = [f"step ratio, paired median {fmt_ci(stat, len(pooled))} = {1 / stat[0]:.2f}x faster"]
        notes += [
            f"M={M}: {1 / statistics.median(r):.2f}x faster, held {by[(a, M)].held_grad_bytes / MiB:.2f} vs "
            f"{by[(b, M)].held_grad_bytes / MiB:.2f} MiB"
            for M, r in per_M.items()
        ]
        return TargetResult(what, status, noted(status, "; ".join(notes)))
    return TargetResult(what, SKIP, "not run")


def check_run_time(results: Results) -> TargetResult:
    """The whole run's wall time, for the presets only: a hand-picked subset has no time target."""
    plan, quick = results.plan, bool(results.plan.get("quick"))
    cluster = bool(plan.get("cluster"))
    preset = (mlp.CLUSTER_QUICK if quick else mlp.CLUSTER) if cluster else mlp.FULL
    kind, where = ("quick" if quick else "full"), ""
    if cluster:
        where = f" simulated-cluster run ({', '.join(links_of(results))})"
    if (cluster or not quick) and any(plan[k] != preset[k] for k in ("sizes", "Ms", "configs", "reps", "steps")):
        what = f"run time target (full or quick {'cluster ' if cluster else ''}run only)"
        return TargetResult(what, SKIP, f"custom run: {results.elapsed_s} s")
    limit = targets.RUN_TIME_S[kind]
    what = f"{kind}{where or ' run'} within {limit} s"
    return TargetResult(what, PASS if results.elapsed_s <= limit else FAIL, f"{results.elapsed_s} s")


def write_report(results: Results, out: Path) -> str:
    """Write results.md and the PNGs into `out`; return the target summary."""
    if results.plan.get("cluster"):
        return write_cluster_report(results, out)
    out = Path(out)
    checked = check_targets(results)
    md = ["# Benchmark results", "", write_table(results), *targets_table(checked)]
    md += ["", "![step time vs M](step_time_vs_M.png)", "", "![memory vs time](memory_vs_time.png)", ""]
    (out / "results.md").write_text("\n".join(md))
    plot_step_times(results, out / "step_time_vs_M.png")
    plot_frontier(results, out / "memory_vs_time.png")
    return targets.format_summary(checked)


# -- the simulated cluster ------------------------------------------------------------------------
def link_results(results: Results, link: str) -> Results:
    """The results of one link bandwidth, shaped like a loopback run's results."""
    return dataclasses.replace(results, runs=[r for r in results.runs if r.link == link])


def links_of(results: Results) -> list[str]:
    return list(dict.fromkeys(r.link for r in results.runs if r.link is not None))


def link_gbit(link: str) -> float:
    return link_bits_per_s(link) / 1e9


def check_cluster_targets(results: Results) -> list[TargetResult]:
    """Per link: the loopback targets the link decides (exact counts, the deferral and window
    margins, HSDP), the margins a slow link must show, and that the 2-host runs' collectives really
    crossed the shaped link; then the run time. Not the wrapper-overhead (2%) and frontier targets,
    which need the loopback run's many rounds per M to resolve."""
    quick = bool(results.plan.get("quick"))
    out = []
    for link in links_of(results):
        sub = link_results(results, link)
        out += [dataclasses.replace(t, target=f"[{link}] {t.target}") for t in check_targets(sub, True)]
        for run in [r for r in sub.runs if r.ranks == 2]:
            big = [M for M in results.plan["Ms"] if M >= 4]
            for name in ("deferred", "window"):
                per_M = paired_ratios(run, "per_micro_batch", name, big)
                what = f"[{link}] {name} {targets.CLUSTER_SPEEDUP.name} across {run.hosts} hosts, M >= 4 ({run.size})"
                if not per_M:
                    out.append(TargetResult(what, SKIP, f"{name} or per_micro_batch not run at M >= 4"))
                    continue
                pooled = [v for r in per_M.values() for v in r]
                status, stat = judge(targets.CLUSTER_SPEEDUP, pooled, quick)
                measured = (
                    f"{stat[0]:.2f}x faster (paired, 95% CI {stat[1]:.2f}-{stat[2]:.2f}, n={len(pooled)}); per M "
                    + ", ".join(f"M={m} {statistics.median(r):.2f}x" for m, r in per_M.items())
                )
                out.append(TargetResult(what, status, noted(status, measured)))
            # Every collective of a 1-rank-per-host run crosses the link; ring bytes are the least
            # a rank can send, so tbf must have counted at least that much (more: headers, warm-up).
            if run.hosts == run.ranks:
                sent = run.ranks * sum(r.bytes_sent_per_step * len(r.step_times_s) for r in run.rows)
                counted = run.link_bytes or 0
                out.append(
                    TargetResult(
                        f"[{link}] {targets.LINK_CROSSED.name} ({run.hosts} hosts x 1 rank)",
                        PASS if counted >= sent else FAIL,
                        f"tbf counted {counted / MiB:.0f} MiB >= {sent / MiB:.0f} MiB the timed "
                        "steps' collectives send (ring formula)",
                    )
                )
    out.append(check_run_time(results))
    return out


def cluster_speedups(results: Results) -> dict[str, dict[float, float]]:
    """name -> {link Gbit/s: per-micro-batch step / its step, median over rounds at the largest M}."""
    M = max(results.plan["Ms"])
    out: dict[str, dict[float, float]] = {}
    for run in results.runs:
        base = baseline_of(run)
        for name in ordered_configs(run):
            if name != base and (per_M := paired_ratios(run, base, name, [M])):
                out.setdefault(name, {})[link_gbit(run.link or "")] = statistics.median(per_M[M])
    return out


def plot_cluster_speedup(results: Results, path: Path) -> None:
    speedups = cluster_speedups(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in speedups.items():
        xs = sorted(points)
        group = mlp.CONFIGS[name]["group"]
        style = "--" if group == "peer" else (":" if group == "hsdp" else "-")
        ax.plot(xs, [points[x] for x in xs], style, marker="o", label=name)
    ax.axhline(1.0, color="k", alpha=0.3)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per host (Gbit/s, tc tbf)")
    ax.set_ylabel(f"speedup over per-micro-batch at M={max(results.plan['Ms'])}")
    hosts = results.plan["cluster"]["hosts"]
    ax.set_title(f"simulated cluster: {hosts} hosts x 1 rank (HSDP dotted: {hosts} hosts x {4 // hosts} ranks)")
    finish_axes(ax)
    save_figure(fig, path)


def write_cluster_table(results: Results) -> str:
    lines = header(results)
    for link in links_of(results):
        sub = link_results(results, link)
        lines += [f"## {link} link per host", ""]
        lines += [
            f"- {r.size}, {r.ranks} ranks = {r.hosts} hosts x {r.ranks_per_host}: "
            f"{(r.link_bytes or 0) / MiB:.0f} MiB through the shaped NICs, {r.wall_s} s"
            for r in sub.runs
        ]
        lines.append("")
        table = write_table(sub)
        lines.append(table[table.index("### ") : table.index("Configurations:")])
    return "\n".join(lines) + "\n"


def write_cluster_report(results: Results, out: Path) -> str:
    """Write results.md and speedup_vs_link.png into `out` for a --cluster run; return the summary."""
    out = Path(out)
    checked = check_cluster_targets(results)
    md = ["# Benchmark results on a simulated cluster", "", write_cluster_table(results), *targets_table(checked)]
    md += ["", "![speedup vs link bandwidth](speedup_vs_link.png)", ""]
    (out / "results.md").write_text("\n".join(md))
    plot_cluster_speedup(results, out / "speedup_vs_link.png")
    return targets.format_summary(checked)
