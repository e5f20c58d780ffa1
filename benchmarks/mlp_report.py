"""The MLP benchmark's report: results.json -> results.md, the PNGs and the target summary
(PASS / FAIL / SKIP / N/D per target of `targets.py`). Over loopback: step_time_vs_M.png and
memory_vs_time.png; on the simulated cluster (runs with a `link`): the tables and targets per link,
the margins a link decides, and speedup_vs_link.png.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from benchmarks import mlp, stats, targets
from benchmarks.records import ConfigResult, Results, Run
from benchmarks.stats import MiB, fmt_ci, judge, judged, pooled, verdict
from benchmarks.targets import FAIL, PASS, SKIP, UNDECIDED, Target, TargetResult
from testbed.cluster import link_bits_per_s

FASTER = "{m:.2f}x faster (paired, 95% CI {lo:.2f}-{hi:.2f}, n={n})"


def index(run: Run) -> dict[tuple[str, int], ConfigResult]:
    return {(r.config, r.M): r for r in run.rows}


def paired_ratios(run: Run, a: str, b: str, Ms: list[int], key: str = "step_times_s") -> dict[int, list[float]]:
    """M -> [a's step / b's step, one per round in which both ran]."""
    by = index(run)
    per_M = {M: stats.paired(by[(a, M)], by[(b, M)], key) for M in Ms if (a, M) in by and (b, M) in by}
    return {M: r for M, r in per_M.items() if r}


def baseline_of(run: Run) -> str:
    """The per-micro-batch configuration ratios are taken against, in this run."""
    return "hsdp_per_micro_batch" if run.ranks == 4 else "per_micro_batch"


def ordered_configs(run: Run) -> list[str]:
    present = {r.config for r in run.rows}
    return [n for n in mlp.CONFIGS if n in present]


def held_bytes(row: ConfigResult) -> int:
    """What a configuration holds per rank between micro-batches: gradients and unsharded params."""
    return row.held_grad_bytes + row.held_param_bytes


# -- table and plots --------------------------------------------------------------------------------
def write_table(results: Results) -> str:
    lines = []
    for run in results.runs:
        f, by, base = run.facts, index(run), baseline_of(run)
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
            "unsharded parameter bytes alive after a backward (what windowing keeps).",
            "",
            f"| configuration | M | step ms | ratio | CPU ms | reduce-scatters | all-reduces | all-gathers | "
            f"MiB sent | held grad MiB | held params MiB | {mem_col} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, M in sorted(by, key=lambda key: (list(mlp.CONFIGS).index(key[0]), key[1])):
            r = by[(name, M)]
            ratio = r.step_time_s / by[(base, M)].step_time_s if (base, M) in by else math.nan
            mem = r.device_peak_bytes if run.device != "cpu" else r.rss_growth_bytes
            counts = " | ".join(stats.fmt_count(getattr(r, f"{k}_per_step")) for k in mlp.KINDS)
            lines.append(
                f"| {name} | {M} | {r.step_time_s * 1e3:.1f} | {ratio:.3f} | {r.step_cpu_s * 1e3:.0f} | {counts} | "
                f"{r.bytes_sent_per_step / MiB:.1f} | {stats.fmt_held(r.held_grad_bytes, r.handle_held_grad_bytes)} | "
                f"{r.held_param_bytes / MiB:.2f} | {(mem or 0) / MiB:.0f} |"
            )
        lines.append("")
    lines += ["Configurations:", "", *(f"- `{n}`: {c['label']}" for n, c in mlp.CONFIGS.items())]
    return "\n".join(lines) + "\n"


def plot(results: Results, out: Path) -> None:
    """step_time_vs_M.png: step time against M; memory_vs_time.png: held memory against step time at
    the largest M, per-micro-batch, deferred and windowed the frontier's corners. A panel per run."""
    runs, M = results.runs, max(results.plan["Ms"])
    (fig, axes), (fig2, axes2) = stats.panels(len(runs), 6, 4.5), stats.panels(len(runs), 6, 4.5)
    for ax, ax2, run in zip(axes, axes2, runs, strict=True):
        by, hsdp = index(run), run.ranks == 4
        corners = [baseline_of(run), "hsdp_deferred" if hsdp else "deferred"] + ([] if hsdp else ["windowed"])
        if len(corners := [c for c in corners if (c, M) in by]) >= 2:
            xs, ys = [held_bytes(by[(c, M)]) / MiB for c in corners], [by[(c, M)].step_time_s * 1e3 for c in corners]
            ax2.plot(xs, ys, "k-", alpha=0.4, label=" - ".join(corners) + " frontier")
        for name in ordered_configs(run):
            Ms, peer = sorted(m for (c, m) in by if c == name), mlp.CONFIGS[name]["group"] == "peer"
            ax.plot(Ms, [by[(name, m)].step_time_s * 1e3 for m in Ms], "--" if peer else "-", marker="o", label=name)
            if (name, M) in by:
                marker = "s" if name.startswith("budget") else ("^" if peer else "o")
                ax2.scatter(
                    held_bytes(by[(name, M)]) / MiB, by[(name, M)].step_time_s * 1e3, marker=marker, s=50, label=name
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(results.plan["Ms"], [str(m) for m in results.plan["Ms"]])
        title = f"{run.size} ({run.facts['params'] / 1e6:.1f} M params, {run.ranks} ranks)"
        ax.set(xlabel="micro-batches per optimizer step (M)", ylabel="median step time (ms)", title=title)
        ax2.set(xlabel="MiB held per rank between micro-batches (gradients + unsharded params)")
        ax2.set(
            ylabel=f"median step time at M={M} (ms)", title=f"{run.size}, {run.ranks} ranks: memory / time trade-off"
        )
    stats.save_figure(fig, axes, out / "step_time_vs_M.png")
    stats.save_figure(fig2, axes2, out / "memory_vs_time.png")


# -- targets ----------------------------------------------------------------------------------
# The overhead pairs of `mlp.PAIRS`: (plugin, peer, the smallest M compared (M = 1 has nothing to
# defer), the peer as the target's line names it).
OVERHEADS = (
    ("deferred", "raw_fsdp2", 2, "the hand-written raw-API loop"),
    ("per_micro_batch", "stock_sync_each_batch", 1, "stock sync_each_batch=True"),
    ("windowed", "raw_windowed", 2, "the hand-written windowed loop"),
    ("windowed", "stock_windowed_by_hand", 2, "the same flags by hand in accelerate's own loop"),
    ("deferred_join", "deferred", 1, "the same loop without grad_sync.join()"),
)
WINDOWED = ("windowed", "raw_windowed", "stock_windowed_by_hand")
# Exact (reduce-scatters, all-reduces) per optimizer step, "MU" = M x U; HSDP also all-reduces
# across replicas on every reduce-scatter it does not defer. Budget modes and auto are
# left out: their plan or their own loop sets how many.
EXPECTED_COUNTS = {
    "per_micro_batch": ("MU", 0),
    "stock_sync_each_batch": ("MU", 0),
    "hsdp_per_micro_batch": ("MU", "MU"),
    "hsdp_deferred": ("U", "U"),
    "hsdp_defer_all_reduce": ("MU", "U"),
    "deferred_join": ("U", "M"),  # join()'s poll: one per micro-batch
    **dict.fromkeys((*WINDOWED, "deferred", "stock_accumulate", "raw_fsdp2", "stock_no_reshard"), ("U", 0)),
}


def check_targets(results: Results, link_decides_only: bool = False) -> list[TargetResult]:
    """Every target of `targets.py` on this run. `link_decides_only` (a simulated-cluster link):
    leave out the wrapper-overhead, frontier and run-time targets, which the loopback run decides."""
    quick, Ms = bool(results.plan.get("quick")), results.plan["Ms"]
    runs, hsdp = [r for r in results.runs if r.ranks == 2], [r for r in results.runs if r.ranks == 4]
    out: list[TargetResult] = []
    if not link_decides_only:
        for a, b, m_min, peer in OVERHEADS:
            what = f"{a.replace('_', '-')} (plugin) within 2% of {peer}"
            out += check_overhead(runs, a, b, [M for M in Ms if m_min <= M], what, quick)
        out += check_planner_cost(runs, quick)
    out += check_counts(runs + hsdp)
    comm = [r for r in runs if r.size == "large"] or runs[-1:]  # the communication-bound model
    margin = f" (clear margin: >= {targets.CLEAR_MARGIN}x)"
    out += [check_speedup(run, "deferred", targets.DEFERRED_SPEEDUP, [4, 8], quick, margin) for run in comm]
    out += [check_speedup(run, "windowed", targets.WINDOWED_SPEEDUP, [8], quick) for run in comm]
    if not link_decides_only:
        out.append(check_frontier(results, runs))
    out.append(check_hsdp(results, hsdp))
    if not link_decides_only:
        out.append(check_run_time(results))
    return out


def check_overhead(runs: list[Run], a: str, b: str, Ms: list[int], what: str, quick: bool) -> list[TargetResult]:
    """a's step / b's step, paired by round and pooled over M, per model: within the tolerance on
    every model; and the sync choice's own cost, from the microbenchmark (robust to step noise)."""
    notes, statuses, shares = [], [], []
    for run in runs:
        if not (per_M := paired_ratios(run, a, b, Ms)):
            continue
        status, stat = judge(targets.WRAPPER_OVERHEAD, pooled(per_M), quick)
        statuses.append(status)
        cpu = pooled(paired_ratios(run, a, b, list(per_M), "step_cpus_s"))
        notes.append(
            f"{run.size}: paired median {fmt_ci(stat, len(pooled(per_M)))}; per M "
            + ", ".join(f"M={m} {statistics.median(r):.3f}" for m, r in per_M.items())
            + (f"; CPU time {statistics.median(cpu):.3f}" if cpu else "")
        )
        # (a's - b's microseconds per micro-batch) x M, as a share of b's step at the largest M.
        by, M = index(run), max(m for (c, m) in index(run) if c == b)
        ua, ub = by[(a, M)].sync_control_us if (a, M) in by else None, by[(b, M)].sync_control_us
        if ua and ub:
            share = (ua - ub) * M * 1e-6 / by[(b, M)].step_time_s
            note = f"{run.size}: {ua:.0f} vs {ub:.0f} us per micro-batch = {share:+.3%} of the step at M={M}"
            shares.append((share, note))
    if not statuses:
        return [TargetResult(what, SKIP, f"{a} or {b} not run")]
    out = [verdict(what, statuses, notes)]
    if shares:
        ok = targets.SYNC_CONTROL.passes(max(v for v, _ in shares))
        what = f"{a}: {targets.SYNC_CONTROL.name}, against {b} (microbenchmark)"
        out.append(TargetResult(what, PASS if ok else FAIL, "; ".join(n for _, n in shares)))
    return out


def check_planner_cost(runs: list[Run], quick: bool) -> list[TargetResult]:
    """The budget planner's reduce-scatter weight for the backend against what the steps paid: per
    round at the largest M, the time deferral saved per reduce-scatter it removed over the time the
    windowed then saved per all-gather it removed (FSDP's copies included; the units are equal)."""
    notes, statuses = [], []
    for run in runs:
        by = index(run)
        M = max((m for (name, m) in by if name == "windowed"), default=None)
        if M is None or not all((n, M) in by for n in ("per_micro_batch", "deferred")):
            continue
        pmb, deferred, windowed = (by[(n, M)] for n in ("per_micro_batch", "deferred", "windowed"))
        rs_removed = pmb.reduce_scatters_per_step - deferred.reduce_scatters_per_step
        ag_removed = deferred.all_gathers_per_step - windowed.all_gathers_per_step
        t0, t1, t2 = stats.per_round(pmb), stats.per_round(deferred), stats.per_round(windowed)
        rounds = sorted(t0.keys() & t1.keys() & t2.keys()) if rs_removed > 0 and ag_removed > 0 else []
        per = [((t0[r] - t1[r]) / rs_removed, (t1[r] - t2[r]) / ag_removed) for r in rounds]
        if not (measured := [rs / ag for rs, ag in per if ag > 0]):
            continue
        planner = run.facts["planner_reduce_scatter_cost"]
        status, stat = judge(targets.PLANNER_COST, [m / planner for m in measured], quick)
        statuses.append(status)
        notes.append(
            f"{run.size}: a reduce-scatter byte cost {statistics.median(measured):.2f} all-gather bytes in the steps "
            f"(deferral's and windowing's savings; measured / planner {fmt_ci(stat, len(measured))}), "
            f"planner {planner:g}"
        )
    return [verdict(targets.PLANNER_COST.name, statuses, notes)] if statuses else []


def check_counts(runs: list[Run]) -> list[TargetResult]:
    """Every timed step's (reduce-scatters, all-reduces) against the configuration's formula, and the
    windowed's point: one all-gather per unit per optimizer step, whatever M is."""
    counts, gathers = [], []
    for run in runs:
        U = run.facts["units"]
        for (name, M), r in index(run).items():
            seen = r.counts_seen_per_step
            if name in EXPECTED_COUNTS:
                got = (seen["reduce_scatters"], seen["all_reduces"])
                want = tuple([{"MU": M * U, "U": U, "M": M, 0: 0}[x]] for x in EXPECTED_COUNTS[name])
                counts.append(got == want or f"{run.size}/{name}/M={M}: (reduce-scatters, all-reduces) {got} != {want}")
            if name in WINDOWED:
                gathers.append(seen["all_gathers"] == [U] or f"{run.size}/{name}/M={M}: {seen['all_gathers']}")
    out = []
    for target, segments in ((targets.COLLECTIVE_COUNTS, counts), (targets.WINDOWED_GATHERS, gathers)):
        bad = [s for s in segments if s is not True]
        status = SKIP if not segments else (FAIL if bad else PASS)
        measured = "; ".join(bad) if bad else f"{len(segments)} (configuration, M) segments, every timed step exact"
        out.append(TargetResult(target.name, status, measured))
    return out


def check_speedup(run: Run, name: str, target: Target, Ms: list[int], quick: bool, note: str = "") -> TargetResult:
    """Per-micro-batch step / `name`'s step, paired by round, judged at each of `Ms` (`note` after the last)."""
    notes, statuses = [], []
    for M, speedups in paired_ratios(run, "per_micro_batch", name, Ms).items():
        status, (m, lo, hi) = judge(target, speedups, quick)
        statuses.append(status)
        notes.append((f"M={M}: " if len(Ms) > 1 else "") + FASTER.format(m=m, lo=lo, hi=hi, n=len(speedups)))
    return verdict(f"{target.name} ({run.size})", statuses, [*notes[:-1], notes[-1] + note] if notes else [], ", ")


def check_frontier(results: Results, runs: list[Run]) -> TargetResult:
    """Each budget point against the frontier (per-micro-batch -> deferred -> windowed) at its held
    bytes: per round, (point - frontier) / per-micro-batch step, from that round's corners."""
    what = f"{targets.FRONTIER.name} (memory vs time, paired by round, M >= 2)"
    notes, statuses = [], []
    for run in runs:
        by = index(run)
        for name in [n for n in ordered_configs(run) if n.startswith("budget")]:
            per_M: dict[int, list[float]] = {}
            for M in [m for m in results.plan["Ms"] if m >= 2 and all((c, m) in by for c in (*mlp.CORNERS, name))]:
                (h0, h1, h2, h) = [held_bytes(by[(c, M)]) for c in (*mlp.CORNERS, name)]
                (t0, t1, t2, t) = [stats.per_round(by[(c, M)]) for c in (*mlp.CORNERS, name)]
                # Which segment the point's held bytes fall in, and how far along it.
                (ha, ta), (hb, tb) = ((h0, t0), (h1, t1)) if h <= h1 else ((h1, t1), (h2, t2))
                where = min(max((h - ha) / (hb - ha), 0), 1) if hb != ha else 0.0
                rounds = sorted(t0.keys() & t1.keys() & t2.keys() & t.keys())
                per_M[M] = [(t[r] - (ta[r] + (tb[r] - ta[r]) * where)) / t0[r] for r in rounds]
            if not (excess := pooled(per_M)):
                continue
            status, stat = judge(targets.FRONTIER, excess, bool(results.plan.get("quick")))
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
    """All-reduce deferral / per-micro-batch step, paired by round and pooled over M >= 2: below 1,
    and the held gradient bytes no more at any M."""
    a, b = "hsdp_defer_all_reduce", "hsdp_per_micro_batch"
    for run in hsdp:
        by = index(run)
        if not (per_M := paired_ratios(run, a, b, [M for M in results.plan["Ms"] if M >= 2])):
            continue
        status, stat = judge(targets.HSDP_SPEEDUP, pooled(per_M), bool(results.plan.get("quick")))
        if not all(by[(a, M)].held_grad_bytes <= by[(b, M)].held_grad_bytes for M in per_M):
            status = FAIL
        notes = [f"step ratio, paired median {fmt_ci(stat, len(pooled(per_M)))} = {1 / stat[0]:.2f}x faster"]
        notes += [
            f"M={M}: {1 / statistics.median(r):.2f}x faster, held {by[(a, M)].held_grad_bytes / MiB:.2f} vs "
            f"{by[(b, M)].held_grad_bytes / MiB:.2f} MiB"
            for M, r in per_M.items()
        ]
        return verdict(targets.HSDP_SPEEDUP.name, [status], notes)
    return TargetResult(targets.HSDP_SPEEDUP.name, SKIP, "not run")


def check_run_time(results: Results) -> TargetResult:
    """The whole run's wall time, for the presets only: a hand-picked subset has no time target."""
    plan, quick = results.plan, bool(results.plan.get("quick"))
    cluster = bool(plan.get("cluster"))
    preset = (mlp.CLUSTER_QUICK if quick else mlp.CLUSTER) if cluster else mlp.FULL
    kind = "quick" if quick else "full"
    if (cluster or not quick) and any(plan[k] != preset[k] for k in ("sizes", "Ms", "configs", "reps", "steps")):
        what = f"run time target (full or quick {'cluster ' if cluster else ''}run only)"
        return TargetResult(what, SKIP, f"custom run: {results.elapsed_s} s")
    limit = targets.RUN_TIME_S[kind]
    where = f" simulated-cluster run ({', '.join(per_link(results))})" if cluster else " run"
    return TargetResult(
        f"{kind}{where} within {limit} s", PASS if results.elapsed_s <= limit else FAIL, f"{results.elapsed_s} s"
    )


def write_report(results: Results, out: Path) -> str:
    """Write results.md and the PNGs into `out`; return the target summary."""
    if results.plan.get("cluster"):
        title, images = "Benchmark results on a simulated cluster", {"speedup_vs_link.png": "speedup vs link bandwidth"}
        tables, checked, draw = [write_cluster_table(results)], check_cluster_targets(results), plot_cluster_speedup
    else:
        images = {"step_time_vs_M.png": "step time vs M", "memory_vs_time.png": "memory vs time"}
        title, tables, checked, draw = "Benchmark results", [write_table(results)], check_targets(results), plot
    return stats.write_report(results, out, title, tables, checked, images, draw)


# -- the simulated cluster ------------------------------------------------------------------------
def per_link(results: Results) -> dict[str, Results]:
    """The results of each link bandwidth, shaped like a loopback run's results."""
    links = dict.fromkeys(r.link for r in results.runs if r.link is not None)
    return {link: dataclasses.replace(results, runs=[r for r in results.runs if r.link == link]) for link in links}


def check_cluster_targets(results: Results) -> list[TargetResult]:
    """Per link: the targets a link decides (not the 2% overhead and frontier ones: they need loopback's
    rounds), the margins a slow link must show, and that the collectives crossed it; the run time."""
    quick, out = bool(results.plan.get("quick")), []
    for link, sub in per_link(results).items():
        out += [dataclasses.replace(t, target=f"[{link}] {t.target}") for t in check_targets(sub, True)]
        for run in [r for r in sub.runs if r.ranks == 2]:
            for name in ("deferred", "windowed"):
                per_M = paired_ratios(run, "per_micro_batch", name, [M for M in results.plan["Ms"] if M >= 4])
                what = f"[{link}] {name} {targets.CLUSTER_SPEEDUP.name} across {run.hosts} hosts, M >= 4 ({run.size})"
                if not per_M:
                    out.append(TargetResult(what, SKIP, f"{name} or per_micro_batch not run at M >= 4"))
                    continue
                each = ", ".join(f"M={m} {statistics.median(r):.2f}x" for m, r in per_M.items())
                out.append(judged(what, targets.CLUSTER_SPEEDUP, pooled(per_M), quick, f"{FASTER}; per M {each}"))
            # Every collective of a 1-rank-per-host run crosses the link; ring bytes are the least a
            # rank can send, so tbf must have counted at least that much (more: headers, warm-up).
            if run.hosts == run.ranks:
                sent = run.ranks * sum(r.bytes_sent_per_step * len(r.step_times_s) for r in run.rows)
                counted = run.link_bytes or 0
                what = f"[{link}] {targets.LINK_CROSSED.name} ({run.hosts} hosts x 1 rank)"
                note = f"tbf counted {counted / MiB:.0f} MiB >= {sent / MiB:.0f} MiB the timed steps' collectives send"
                out.append(TargetResult(what, PASS if counted >= sent else FAIL, note + " (ring formula)"))
    return [*out, check_run_time(results)]


def plot_cluster_speedup(results: Results, out: Path) -> None:
    """speedup_vs_link.png, per configuration: per-micro-batch step / its step at the largest M
    against the link's Gbit/s."""
    M, speedups = max(results.plan["Ms"]), {}
    for run in results.runs:
        base = baseline_of(run)
        for name in ordered_configs(run):
            if name != base and (per_M := paired_ratios(run, base, name, [M])):
                speedups.setdefault(name, {})[link_bits_per_s(run.link or "") / 1e9] = statistics.median(per_M[M])
    fig, (ax,) = stats.panels(1, 7, 4.5)
    for name, points in speedups.items():
        style = {"peer": "--", "hsdp": ":"}.get(mlp.CONFIGS[name]["group"], "-")
        ax.plot(sorted(points), [points[x] for x in sorted(points)], style, marker="o", label=name)
    ax.axhline(1.0, color="k", alpha=0.3)
    ax.set_xscale("log")
    hosts = results.plan["cluster"]["hosts"]
    ax.set(xlabel="link bandwidth per host (Gbit/s, tc tbf)", ylabel=f"speedup over per-micro-batch at M={M}")
    ax.set_title(f"simulated cluster: {hosts} hosts x 1 rank (HSDP dotted: {hosts} hosts x {4 // hosts} ranks)")
    stats.save_figure(fig, [ax], out / "speedup_vs_link.png")


def write_cluster_table(results: Results) -> str:
    lines = []
    for link, sub in per_link(results).items():
        lines += [f"## {link} link per host", ""]
        lines += [
            f"- {r.size}, {r.ranks} ranks = {r.hosts} hosts x {r.ranks_per_host}: "
            f"{(r.link_bytes or 0) / MiB:.0f} MiB through the shaped NICs, {r.wall_s} s"
            for r in sub.runs
        ]
        table = write_table(sub)
        lines += ["", table[: table.index("Configurations:")]]
    return "\n".join(lines) + "\n"
