"""The simulated cluster's report (`python -m benchmarks.run --cluster`): results.md with the
loopback report's tables and targets per link, the margins the link decides, and
speedup_vs_link.png.

Each run of a cluster results.json carries its `link` (tc rate), `hosts`, `ranks_per_host` and
`link_bytes` (what tbf counted on the hosts' NICs).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from benchmarks import registry, targets
from benchmarks.cluster import link_bits_per_s
from benchmarks.records import Results
from benchmarks.report import (
    MiB,
    baseline_of,
    check_targets,
    finish_axes,
    header,
    judge,
    noted,
    ordered_configs,
    paired_ratios,
    plt,
    save_figure,
    targets_table,
    write_table,
)
from benchmarks.targets import FAIL, PASS, SKIP, TargetResult


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
    crossed the shaped link; then the run time. Not the wrapper-overhead (2%) and frontier targets:
    the loopback run resolves those with 36 rounds per M; a few rounds per link on a shared machine
    cannot."""
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
    plan = results.plan
    kind = "quick" if quick else "full"
    default = registry.CLUSTER_QUICK if quick else registry.CLUSTER
    if all(plan[k] == default[k] for k in ("sizes", "Ms", "configs", "reps", "steps")):
        limit = targets.RUN_TIME_S[kind]
        out.append(
            TargetResult(
                f"{kind} simulated-cluster run ({', '.join(links_of(results))}) within {limit} s",
                PASS if results.elapsed_s <= limit else FAIL,
                f"{results.elapsed_s} s",
            )
        )
    else:
        out.append(
            TargetResult("run time target (full or quick cluster run only)", SKIP, f"custom run: {results.elapsed_s} s")
        )
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
        group = registry.CONFIGS[name]["group"]
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
