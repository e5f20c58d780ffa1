"""The GRPO benchmark's report: results.json -> results.md (a table per network),
grpo_step_split.png (each configuration's step split into phases) and the target summary (PASS /
FAIL / SKIP / N/D, of the GRPO targets in `targets.py`): windowed's speedup over stock, its
all-gathers, no all-reduce in its generation, the floor (its step and its memory between steps
against DDP's), the reference model kept resident and the identity with stock. Timing targets are
judged on per-round ratios (`speedup`), counts on every recorded step.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks import grpo, stats, targets
from benchmarks.records import GrpoResults, GrpoRow, GrpoRun
from benchmarks.stats import MiB, fmt_count, fmt_held, judged, paired, panels, save_figure
from benchmarks.targets import FAIL, PASS, SKIP, TargetResult

PHASES = {  # phase -> (label, color)
    "generation": ("generation", "tab:orange"),
    "logprob": ("log-prob passes (no grad)", "tab:purple"),
    "scoring": ("scoring", "tab:gray"),
    "training": ("training", "tab:blue"),
}
LEGEND = (
    "Step ms: median wall time of an optimizer step (slowest rank), in brackets the spread of the rounds' "
    "medians (min-max). Speedup: stock's step / this step, per round, median over rounds; x DDP: this step / "
    "DDP's, the same way, with its spread over rounds (DDP runs in launches of its own, each right after "
    "FSDP2's launch of the same round). Phase ms: medians of the same steps. All-gathers per step on one rank "
    "in generation / log-prob passes (the reference model's, or LoRA's policy with the adapter off, when "
    "beta > 0) / training; reduce-scatters and MiB sent (ring formula) over the whole step (DDP's all-reduces "
    "run inside its reducer, uncounted). Held: gradient and unsharded parameter bytes on one rank after a "
    "backward (the plugin's own held-gradient measure in brackets); state: params, grads and optimizer state "
    "of both models on one rank after the optimizer step, and against DDP's; RSS: the step's peak resident "
    "growth."
)


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
    per_round = paired(rows[base], rows[config])
    return (statistics.median(per_round), per_round) if per_round else None


def pair_over_all_reduce(run: GrpoRun) -> float | None:
    """This network's all-gather + reduce-scatter of the model over its all-reduce of the same bytes."""
    b = run.backend_ms
    return (b["all_gather"] + b["reduce_scatter"]) / b["all_reduce"] if b and b.get("all_reduce") else None


def fmt_rounds(paired: list[float]) -> str:
    """A `judged` measured string: the median, then each round's ratio and their spread."""
    spread = f"; spread {min(paired):.2f}x-{max(paired):.2f}x" if len(paired) > 1 else ""
    return "{m:.2f}x, median of {n} round(s) (per round: " + ", ".join(f"{x:.2f}x" for x in paired) + spread + ")"


def fmt_spread(values: list[float], scale: float = 1.0, fmt: str = "{:.0f}", unit: str = "") -> str:
    """' (min-max)' of several rounds' values, or nothing for one."""
    if len(values) < 2:
        return ""
    return f" ({fmt.format(min(values) * scale)}-{fmt.format(max(values) * scale)}{unit})"


def write_table(results: GrpoResults) -> str:
    lines = []
    for run in results.runs:
        f = run.facts
        units = sorted({r.units for r in run.rows if not grpo.is_ddp(r.config)})
        lines += [
            f"### {network(run)}: Qwen2 {f['params'] / 1e6:.2f} M params (hidden {f['hidden']}, {f['layers']} layers, "
            f"vocab {f['vocab']}), FSDP2 units U = {'/'.join(map(str, units))} (full/LoRA), 2 ranks, M = {f['M']}, "
            f"{f['batch']} completion per micro-batch, {f['generations']} per prompt, {f['completion']} tokens"
            + (f"; {run.link_bytes / MiB:.0f} MiB through the shaped NICs" if run.link_bytes else ""),
            "",
            LEGEND,
            "",
            "| configuration | step ms | speedup | x DDP | generation ms | log-prob ms | scoring ms | training ms | "
            "all-gathers gen / log-prob / train | reduce-scatters | MiB sent | held grad MiB | held params MiB | "
            "state MiB | state x DDP | RSS growth MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = rows_of(run)
        lines += [table_row(run, rows[name]) for name in grpo.CONFIGS if name in rows]
        lines += ["", backend_line(run)] if run.backend_ms else []
        lines += [line for name in grpo.CONFIGS if name in rows and (line := resident_line(run, rows[name]))]
        lines.append("")
    lines += ["Configurations (each for full fine-tuning and for LoRA on q_proj, v_proj):", ""]
    lines += [f"- `{mode}`: {label}" for mode, (_, label) in grpo.MODES.items()]
    return "\n".join(lines) + "\n"


def table_row(run: GrpoRun, r: GrpoRow) -> str:
    tuning = r.config.split("/")[0]
    sp = speedup(run, r.config, f"{tuning}/stock")
    floor = speedup(run, f"{tuning}/{grpo.DDP}", r.config)  # this step / DDP's, per round
    ddp = rows_of(run).get(f"{tuning}/{grpo.DDP}")
    state = f"{r.state_bytes / ddp.state_bytes:.2f}x" if ddp and ddp.state_bytes else "-"
    c, ph, held = r.counts_per_step, r.phase_time_s, fmt_held(r.held_grad_bytes, r.handle_held_grad_bytes)
    x_ddp = f"{floor[0]:.2f}x{fmt_spread(floor[1], fmt='{:.2f}', unit='x')}" if floor else "-"
    x_ddp = "1.00x" if floor and grpo.is_ddp(r.config) else x_ddp  # itself: no spread to show
    return (
        f"| {r.config} | {r.step_time_s * 1e3:.0f}{fmt_spread(list(stats.per_round(r).values()), 1e3)} | "
        f"{f'{sp[0]:.2f}x' if sp else '-'} | {x_ddp} | "  # no stock row: no speedup to show
        + " | ".join(f"{ph[p] * 1e3:.0f}" for p in PHASES)
        + f" | {' / '.join(fmt_count(c[p]['all_gathers']) for p in ('generation', 'logprob', 'training'))} | "
        f"{fmt_count(sum(c[p]['reduce_scatters'] for p in PHASES))} | "
        f"{sum(c[p]['bytes_sent'] for p in PHASES) / MiB:.0f} | {held} | "
        f"{r.held_param_bytes / MiB:.2f} | {r.state_bytes / MiB:.2f} | {state} | {r.rss_growth_bytes / MiB:.0f} |"
    )


def resident_line(run: GrpoRun, r: GrpoRow) -> str | None:
    """What keeping the reference model unsharded costs between steps, for a configuration that does."""
    if not r.ref_unsharded_bytes:
        return None
    ddp = rows_of(run).get(f"{r.config.split('/')[0]}/{grpo.DDP}")
    against = f" against DDP's {ddp.state_bytes / MiB:.2f} MiB" if ddp and ddp.state_bytes else ""
    gathers = "; ".join(", ".join(map(str, steps)) for steps in r.logprob_gathers)
    return (
        f"\n{r.config} keeps the reference model unsharded ({r.ref_units} FSDP2 unit(s)): "
        f"{r.ref_unsharded_bytes / MiB:.2f} MiB of its unsharded params stay on every rank between optimizer "
        f"steps, in its state of {r.state_bytes / MiB:.2f} MiB per rank{against}; the log-prob passes' all-gathers "
        f"at steps 1, 2, ... of each round: {gathers}."
    )


def plot_step_split(results: GrpoResults, out: Path) -> None:
    """grpo_step_split.png, one panel per network: each configuration's median step as stacked phases."""
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
    save_figure(fig, axes, out / "grpo_step_split.png")


def backend_line(run: GrpoRun) -> str:
    """What the collectives alone cost on this network: the part of the gap to DDP no sync mode can close."""
    b, mib = run.backend_ms, run.facts["params"] * 4 / MiB
    return (
        f"Collectives alone on this network (rank 0 of FSDP2's launches, median of 3 in each, median over the "
        f"launches; the model's {mib:.1f} MiB of fp32 params): all-gather {b['all_gather']:.0f} ms, reduce-scatter "
        f"{b['reduce_scatter']:.0f} ms, all-reduce {b['all_reduce']:.0f} ms. Windowed's pair per step moves the "
        f"bytes of DDP's one all-reduce and costs {pair_over_all_reduce(run):.2f}x it here, before FSDP2's copies "
        "in and out; with beta > 0 a reference model resharded after its log-prob pass adds one all-gather per "
        "step that DDP, which replicates it, does not need (kept resident: none after step 1)."
    )


# -- targets --------------------------------------------------------------------------------------
def check_targets(results: GrpoResults) -> list[TargetResult]:
    quick, beta = bool(results.plan.get("quick")), float(results.plan.get("beta") or 0.0)
    out = []
    for run in results.runs:
        where, rows = network(run), rows_of(run)
        target = targets.GRPO_WINDOWED_SPEEDUP.get(run.link)
        for tuning in grpo.TUNINGS:
            windowed, stock = f"{tuning}/windowed", f"{tuning}/stock"
            if target is not None:  # stock's step / windowed's per round, their median against the target
                what = f"[{where}] {windowed} {target.name.replace('than stock', f'than {stock}')}"
                if (sp := speedup(run, windowed, stock)) is None:
                    out.append(TargetResult(what, SKIP, "not run"))
                else:
                    out.append(judged(what, target, sp[1], quick, fmt_rounds(sp[1])))
            if windowed in rows:
                out.append(check_windowed_gathers(where, rows[windowed]))
                out.append(check_generation_all_reduces(where, rows[windowed], rows.get(stock), tuning))
                if grpo.keeps_reference(windowed):
                    out.append(check_reference(where, rows[windowed], beta))
            out += check_floor(run, where, tuning, quick)
        out += check_identical(where, rows, beta)
    return out


def check_floor(run: GrpoRun, where: str, tuning: str, quick: bool) -> list[TargetResult]:
    """Windowed against DDP, the data-parallel floor: its step time within 1.10x (the median of
    the per-round ratios), its memory between optimizer steps below DDP's."""
    rows, windowed, ddp = rows_of(run), f"{tuning}/windowed", f"{tuning}/{grpo.DDP}"
    time_what = f"[{where}] {windowed} {targets.GRPO_DDP_FLOOR.name.replace('DDP', ddp)}"
    state_what = f"[{where}] {windowed}: {targets.GRPO_STATE.name.replace('DDP', ddp)}"
    if windowed not in rows or ddp not in rows:
        return [TargetResult(time_what, SKIP, "not run"), TargetResult(state_what, SKIP, "not run")]
    ratio = speedup(run, ddp, windowed)
    assert ratio is not None  # both ran, in the same rounds
    measured = fmt_rounds(ratio[1])
    if (pair := pair_over_all_reduce(run)) is not None:
        measured += f"; collectives alone: all-gather + reduce-scatter = {pair:.2f}x all-reduce of the same bytes"
    w, d = rows[windowed], rows[ddp].state_bytes
    state = f"{w.state_bytes / MiB:.2f} MiB against {d / MiB:.2f} MiB per rank" + (
        f" ({w.state_bytes / d:.2f}x)" if d else ""
    )
    if w.ref_unsharded_bytes:
        state += f"; of it, the reference model kept unsharded: {w.ref_unsharded_bytes / MiB:.2f} MiB"
    if w.resident_bytes:  # keep_frozen_unsharded's price, said; the target reads the rest
        state += (
            f"; of it, the frozen base kept unsharded for the run: {w.resident_bytes / MiB:.2f} MiB, "
            f"without which {(w.state_bytes - w.resident_bytes) / MiB:.2f} MiB"
        )
    state_result = TargetResult(state_what, PASS if w.state_bytes - w.resident_bytes < d else FAIL, state)
    return [judged(time_what, targets.GRPO_DDP_FLOOR, ratio[1], quick, measured), state_result]


def check_windowed_gathers(where: str, row: GrpoRow) -> TargetResult:
    """Windowed gathers each unit of the trained model once per step (a reference model's log-prob
    passes are a model of their own): at generation's first forward, kept to the optimizer step;
    units kept unsharded for the run (keep_frozen_unsharded) never after step 1."""
    U, seen = row.units - row.resident_units, row.counts_seen  # resident units: gathered at step 1 only
    trained = {g + t for g in seen["generation"]["all_gathers"] for t in seen["training"]["all_gathers"]}
    what = f"[{where}] {row.config}: {targets.GRPO_WINDOWED_GATHERS.name}"
    kept = f" ({row.units} units, {row.resident_units} kept unsharded for the run)" if row.resident_units else ""
    detail = (
        f"U = {U}{kept}; every timed step: generation {seen['generation']['all_gathers']}, training "
        f"{seen['training']['all_gathers']} (log-prob passes: {seen['logprob']['all_gathers']})"
    )
    return TargetResult(what, PASS if trained == {U} else FAIL, detail)


def check_generation_all_reduces(where: str, row: GrpoRow, stock: GrpoRow | None, tuning: str) -> TargetResult:
    """Windowed's generation issues no all-reduce per decoded token: transformers' per-token flag
    all-reduce (`synced_gpus`) is skipped where every unit stays unsharded
    (runtime/generating/token_sync.py); where the model's forwards draw random numbers there
    (`grpo.GENERATION_DRAWS`) one all-reduce per generation (TRL generates once per step here) is
    left, the one that tells the rank done first how many forwards to replay."""
    seen = row.counts_seen["generation"].get("all_reduces", [])
    expected = [1] if grpo.GENERATION_DRAWS[tuning] else [0]
    what = f"[{where}] {row.config}: {targets.GRPO_GENERATION_ALL_REDUCES.name}"
    theirs = f", {stock.config}'s {stock.counts_seen['generation'].get('all_reduces', [])}" if stock else ""
    drawn = "dropout active in generation: " if grpo.GENERATION_DRAWS[tuning] else ""
    detail = f"{drawn}generation's all-reduces on every timed step: {seen}{theirs}"
    return TargetResult(what, PASS if seen == expected else FAIL, detail)


def check_reference(where: str, row: GrpoRow, beta: float) -> TargetResult:
    """A configuration that keeps the reference model resident: its log-prob passes all-gather each
    of the reference model's units once, at step 1 (its first forward), and nothing at any later step;
    counted around `torch.distributed` on rank 0, every round."""
    what = f"[{where}] {row.config}: {targets.GRPO_REFERENCE_RESIDENT.name}"
    if not row.logprob_gathers:
        return TargetResult(what, SKIP, "not recorded (a results.json from before the count)")
    if not row.ref_units:
        why = "beta 0: no reference model" if beta == 0 else "no reference model of its own (FSDP2-wrapped)"
        return TargetResult(what, SKIP, why)
    first = sorted({steps[0] for steps in row.logprob_gathers})
    after = sorted({n for steps in row.logprob_gathers for n in steps[1:]})
    detail = (
        f"the reference model's {row.ref_units} FSDP2 unit(s); log-prob passes' all-gathers per step, steps 1, 2, "
        f"... of each round: {'; '.join(', '.join(map(str, steps)) for steps in row.logprob_gathers)}"
    )
    ok = first == [row.ref_units] and after == [0]
    return TargetResult(what, PASS if ok else FAIL, detail)


def check_identical(where: str, rows: dict[str, GrpoRow], beta: float = 0.0) -> list[TargetResult]:
    """Every configuration's completion digests and rewards equal stock's exactly, at every step of
    every round, and its logged values too (loss, reward, reward_std and, with beta > 0, kl), within
    `grpo.LOG_RTOL` for the modes that sum gradients in another order (`grpo.REORDERED`)."""
    out = []
    for tuning in grpo.TUNINGS:
        stock = rows.get(f"{tuning}/stock")
        others = [n for n in grpo.CONFIGS if n.startswith(tuning + "/") and n in rows and n != f"{tuning}/stock"]
        what = f"[{where}] {tuning}: {targets.GRPO_IDENTICAL.name}"
        if stock is None or not others:
            out.append(TargetResult(what, SKIP, "stock or no other configuration run"))
            continue
        ref, bad, rel = recorded(stock, 0), [], 0.0
        logged = sorted({key for entry in ref["logs"] for key in entry} - {"step"})
        if beta > 0 and "kl" not in logged:
            bad.append(f"beta {beta:g} but stock logged no kl (logged: {', '.join(logged)})")
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
            f"logged {', '.join(logged)} and recorded completions and rewards at every step"
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
    pairs = [(x, b[key]) for a, b in zip(got, ref, strict=True) for key, x in a.items()]
    return max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in pairs if x != y), default=0.0)


def first_difference(got: dict, ref: dict) -> str:
    if len(got["logs"]) != len(ref["logs"]):
        return f" ({len(got['logs'])} logged steps vs stock's {len(ref['logs'])})"
    for a, b in zip(got["logs"], ref["logs"], strict=True):
        for key in ("loss", "kl", "reward"):
            if a.get(key) != b.get(key):
                return f" (step {a.get('step')}: {key} {a.get(key)!r} vs stock {b.get(key)!r})"
    return ""


def write_report(results: GrpoResults, out: Path) -> str:
    """Write results.md and grpo_step_split.png into `out`; return the target summary."""
    images = {"grpo_step_split.png": "GRPO step split"}
    tables, checked = [write_table(results)], check_targets(results)
    return stats.write_report(results, out, "GRPO benchmark results", tables, checked, images, plot_step_split)
