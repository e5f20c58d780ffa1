"""The GRPO benchmark's report: results.json -> results.md (a table per network),
grpo_step_split.png (each configuration's step split into phases) and the target summary
(PASS / FAIL / SKIP / N/D, of the GRPO targets in `targets.py`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks import grpo, targets
from benchmarks.records import GrpoResults, GrpoRow, GrpoRun
from benchmarks.stats import MiB, by_round, fmt_count, fmt_held, header, judged, panels, ratios, save_figure, write_md
from benchmarks.targets import FAIL, PASS, SKIP, TargetResult

PHASES = {  # phase -> (label, color)
    "generation": ("generation", "tab:orange"),
    "logprob": ("log-prob passes (no grad)", "tab:purple"),
    "scoring": ("scoring", "tab:gray"),
    "training": ("training", "tab:blue"),
}


def network(run: GrpoRun) -> str:
    return "loopback" if run.link is None else f"{run.link} link, 2 hosts"


def rows_of(run: GrpoRun) -> dict[str, GrpoRow]:
    return {r.config: r for r in run.rows}


def speedup(run: GrpoRun, config: str, base: str) -> tuple[float, list[float]] | None:
    """base's step / config's step: the median over rounds of the ratio of each round's medians
    (both ran in the same round, under the same load), and the per-round ratios."""
    rows = rows_of(run)
    if config not in rows or base not in rows:
        return None
    a, b = (by_round(rows[n].step_rounds, rows[n].step_times_s) for n in (config, base))
    paired = ratios(b, a)
    return (statistics.median(paired), paired) if paired else None


def write_table(results: GrpoResults) -> str:
    lines = header("GRPO benchmark results", results)
    for run in results.runs:
        f = run.facts
        units = sorted({r.units for r in run.rows if not grpo.is_ddp(r.config)})
        lines += [
            f"### {network(run)}: Qwen2 {f['params'] / 1e6:.2f} M params (hidden {f['hidden']}, {f['layers']} layers, "
            f"vocab {f['vocab']}), FSDP2 units U = {'/'.join(map(str, units))} (full/LoRA), 2 ranks, M = {f['M']}, "
            f"{f['batch']} completion per micro-batch, {f['generations']} per prompt, {f['completion']} tokens"
            + (f"; {run.link_bytes / MiB:.0f} MiB through the shaped NICs" if run.link_bytes else ""),
            "",
            "Step ms: median wall time of an optimizer step (slowest rank). Speedup: stock's step / this step, per "
            "round, median over rounds; x DDP: this step / DDP's, the same way (DDP runs in its own launch). Phase "
            "ms: medians of the same steps. All-gathers per step on one rank in generation / log-prob passes "
            "(the reference model's, or LoRA's policy with the adapter off, when beta > 0) / training; "
            "reduce-scatters and MiB sent (ring formula) over the whole step (DDP's all-reduces run inside its "
            "reducer, uncounted). Held: gradient and unsharded parameter bytes on one rank after a backward (the "
            "plugin's own held-gradient measure in brackets); state: params, grads and optimizer state of both "
            "models on one rank after the optimizer step, and against DDP's; RSS: the step's peak resident growth.",
            "",
            "| configuration | step ms | speedup | x DDP | generation ms | log-prob ms | scoring ms | training ms | "
            "all-gathers gen / log-prob / train | reduce-scatters | MiB sent | held grad MiB | held params MiB | "
            "state MiB | state x DDP | RSS growth MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = rows_of(run)
        for name in [n for n in grpo.CONFIGS if n in rows]:
            r = rows[name]
            tuning = name.split("/")[0]
            sp = speedup(run, name, f"{tuning}/stock")
            floor = speedup(run, f"{tuning}/{grpo.DDP}", name)  # this step / DDP's
            ddp = rows.get(f"{tuning}/{grpo.DDP}")
            state = f"{r.state_bytes / ddp.state_bytes:.2f}x" if ddp and ddp.state_bytes else "-"
            c, ph = r.counts_per_step, r.phase_time_s
            held = fmt_held(r.held_grad_bytes, r.handle_held_grad_bytes)
            lines.append(
                f"| {name} | {r.step_time_s * 1e3:.0f} | {sp[0] if sp else math.nan:.2f}x | "
                f"{f'{floor[0]:.2f}x' if floor else '-'} | "
                + " | ".join(f"{ph[p] * 1e3:.0f}" for p in PHASES)
                + f" | {' / '.join(fmt_count(c[p]['all_gathers']) for p in ('generation', 'logprob', 'training'))} | "
                f"{fmt_count(sum(c[p]['reduce_scatters'] for p in PHASES))} | "
                f"{sum(c[p]['bytes_sent'] for p in PHASES) / MiB:.0f} | {held} | {r.held_param_bytes / MiB:.2f} | "
                f"{r.state_bytes / MiB:.2f} | {state} | {r.rss_growth_bytes / MiB:.0f} |"
            )
        lines += ["", backend_line(run)] if run.backend_ms else []
        lines.append("")
    lines += ["Configurations (each for full fine-tuning and for LoRA on q_proj, v_proj):", ""]
    lines += [f"- `{mode}`: {label}" for mode, (_, label) in grpo.MODES.items()]
    return "\n".join(lines) + "\n"


def plot_step_split(results: GrpoResults, path: Path) -> None:
    """One panel per network: each configuration's median step as stacked phases."""
    fig, axes = panels(len(results.runs), 7, 5.5)
    for ax, run in zip(axes, results.runs, strict=True):
        rows = rows_of(run)
        names = [n for n in grpo.CONFIGS if n in rows]
        left = [0.0] * len(names)
        for phase, (label, color) in PHASES.items():
            widths = [rows[n].phase_time_s[phase] for n in names]
            if any(widths):
                ax.barh(names, widths, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.invert_yaxis()
        ax.set(xlabel="median GRPO step (s)", title=f"{network(run)}: where a GRPO step goes")
    save_figure(fig, axes, path)


def check_targets(results: GrpoResults) -> list[TargetResult]:
    quick = bool(results.plan.get("quick"))
    out = []
    for run in results.runs:
        where, rows = network(run), rows_of(run)
        target = targets.GRPO_WINDOW_SPEEDUP.get(run.link)
        for tuning in grpo.TUNINGS:
            window, stock = f"{tuning}/window", f"{tuning}/stock"
            if target is not None:  # stock's step / the window's per round, their median against the target
                what = f"[{where}] {window} {target.name.replace('than stock', f'than {stock}')}"
                if (sp := speedup(run, window, stock)) is None:
                    out.append(TargetResult(what, SKIP, "not run"))
                else:
                    per_round = "{m:.2f}x (per round: " + ", ".join(f"{x:.2f}x" for x in sp[1]) + ")"
                    out.append(judged(what, target, sp[1], quick, per_round))
            if window in rows:
                out.append(check_window_gathers(where, rows[window]))
            out += check_floor(run, where, tuning, quick)
        out += check_identical(where, rows)
    return out


def pair_over_all_reduce(run: GrpoRun) -> float | None:
    """This network's all-gather + reduce-scatter of the model over its all-reduce of the same bytes."""
    b = run.backend_ms
    return (b["all_gather"] + b["reduce_scatter"]) / b["all_reduce"] if b and b.get("all_reduce") else None


def backend_line(run: GrpoRun) -> str:
    """What the collectives alone cost on this network: the part of the gap to DDP no sync mode can close."""
    b, mib = run.backend_ms, run.facts["params"] * 4 / MiB
    return (
        f"Collectives alone on this network (rank 0 of the FSDP2 launch, median of 3, the model's {mib:.1f} MiB of "
        f"fp32 params): all-gather {b['all_gather']:.0f} ms, reduce-scatter {b['reduce_scatter']:.0f} ms, all-reduce "
        f"{b['all_reduce']:.0f} ms. The window's pair per step moves the bytes of DDP's one all-reduce and costs "
        f"{pair_over_all_reduce(run):.2f}x it here, before FSDP2's copies in and out; with beta > 0 the reference "
        "model adds one all-gather per step that DDP, which replicates it, does not need."
    )


def check_floor(run: GrpoRun, where: str, tuning: str, quick: bool) -> list[TargetResult]:
    """The window against DDP, the data-parallel floor: its step time within 1.10x, its memory
    between optimizer steps below DDP's (sharded)."""
    rows, window, ddp = rows_of(run), f"{tuning}/window", f"{tuning}/{grpo.DDP}"
    time_what = f"[{where}] {window} {targets.GRPO_DDP_FLOOR.name.replace('DDP', ddp)}"
    state_what = f"[{where}] {window}: {targets.GRPO_SHARDED_STATE.name.replace('DDP', ddp)}"
    if window not in rows or ddp not in rows:
        return [TargetResult(time_what, SKIP, "not run"), TargetResult(state_what, SKIP, "not run")]
    ratio = speedup(run, ddp, window)
    assert ratio is not None  # both ran, in the same rounds
    per_round = "{m:.2f}x (per round: " + ", ".join(f"{x:.2f}x" for x in ratio[1]) + ")"
    if (pair := pair_over_all_reduce(run)) is not None:
        per_round += f"; collectives alone: all-gather + reduce-scatter = {pair:.2f}x all-reduce of the same bytes"
    w, d = rows[window].state_bytes, rows[ddp].state_bytes
    state = TargetResult(state_what, PASS if w < d else FAIL, f"{w / MiB:.2f} MiB against {d / MiB:.2f} MiB per rank")
    return [judged(time_what, targets.GRPO_DDP_FLOOR, ratio[1], quick, per_round), state]


def check_window_gathers(where: str, row: GrpoRow) -> TargetResult:
    """The window gathers each unit of the trained model once per step (a reference model's log-prob
    passes are a model of their own): at generation's first forward, kept to the optimizer step."""
    U, seen = row.units, row.counts_seen
    trained = {g + t for g in seen["generation"]["all_gathers"] for t in seen["training"]["all_gathers"]}
    what = f"[{where}] {row.config}: {targets.GRPO_WINDOW_GATHERS.name}"
    detail = (
        f"U = {U}; every timed step: generation {seen['generation']['all_gathers']}, training "
        f"{seen['training']['all_gathers']} (reference log-prob passes, a model of their own: "
        f"{seen['logprob']['all_gathers']})"
    )
    return TargetResult(what, PASS if trained == {U} else FAIL, detail)


def check_identical(where: str, rows: dict[str, GrpoRow]) -> list[TargetResult]:
    """Every configuration's completion digests and rewards equal stock's exactly, at every step of
    every round, and its logged values too, within `grpo.LOG_RTOL` for the modes that sum gradients
    in another order (`grpo.REORDERED`)."""
    out = []
    for tuning in grpo.TUNINGS:
        stock = rows.get(f"{tuning}/stock")
        others = [n for n in grpo.CONFIGS if n.startswith(tuning + "/") and n in rows and n != f"{tuning}/stock"]
        what = f"[{where}] {tuning}: {targets.GRPO_IDENTICAL.name}"
        if stock is None or not others:
            out.append(TargetResult(what, SKIP, "stock or no other configuration run"))
            continue
        ref, bad, rel = recorded(stock, 0), [], 0.0
        for name, k in [(n, k) for n in others for k in range(len(rows[n].logs))]:
            got, reordered = recorded(rows[name], k), grpo.CONFIGS[name]["mode"] in grpo.REORDERED
            diff = [key for key in ref if got[key] != ref[key] and not (key == "logs" and reordered)]
            if reordered:
                off = log_difference(got["logs"], ref["logs"])
                if off is None or off > grpo.LOG_RTOL:
                    diff.append("logs")
                else:
                    rel = max(rel, off)
            if diff:
                bad.append(f"{name} round {k}: {', '.join(diff)} differ{first_difference(got, ref)}")
        if any(recorded(stock, k) != ref for k in range(len(stock.logs))):
            bad.append("stock differs between its own rounds")
        measured = (
            f"{', '.join(others)} vs stock: {len(ref['logs'])} steps x {len(stock.logs)} round(s), "
            "losses and rewards logged, completions and rewards recorded"
            + (f"; {'/'.join(grpo.REORDERED)}'s logged values at most {rel:.1e} relative off" if rel else "")
        )
        out.append(TargetResult(what, FAIL, "; ".join(bad)) if bad else TargetResult(what, PASS, measured))
    return out


def recorded(row: GrpoRow, k: int) -> dict:
    """What round k of a configuration must share with stock: logs, rewards, completion digests."""
    return {"logs": row.logs[k], "rewards": row.rewards[k], "completions": row.completions[k]}


def log_difference(got: list[dict], ref: list[dict]) -> float | None:
    """The largest relative difference between two runs' logged values, step by step; None when
    they log different steps or keys (that is no rounding)."""
    if [sorted(a) for a in got] != [sorted(b) for b in ref]:
        return None
    off = 0.0
    for a, b in zip(got, ref, strict=True):
        for key, x in a.items():
            y = b[key]
            off = max(off, abs(x - y) / max(abs(x), abs(y), 1e-30)) if x != y else off
    return off


def first_difference(got: dict, ref: dict) -> str:
    if len(got["logs"]) != len(ref["logs"]):
        return f" ({len(got['logs'])} logged steps vs stock's {len(ref['logs'])})"
    for a, b in zip(got["logs"], ref["logs"], strict=True):
        for key in ("loss", "reward"):
            if a.get(key) != b.get(key):
                return f" (step {a.get('step')}: {key} {a.get(key)!r} vs stock {b.get(key)!r})"
    return ""


def write_report(results: GrpoResults, out: Path) -> str:
    """Write results.md and grpo_step_split.png into `out`; return the target summary."""
    checked = check_targets(results)
    write_md(Path(out), [write_table(results)], checked, {"grpo_step_split.png": "GRPO step split"})
    plot_step_split(results, Path(out) / "grpo_step_split.png")
    return targets.format_summary(checked)
