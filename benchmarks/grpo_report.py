"""The GRPO benchmark's report: results.json -> results.md (a table per network),
grpo_step_split.png (each configuration's step split into phases) and the target summary
(PASS / FAIL / SKIP / N/D, of the GRPO targets in `targets.py`).
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks import grpo, stats
from benchmarks.grpo_checks import check_targets, network, pair_over_all_reduce, rows_of, speedup
from benchmarks.records import GrpoResults, GrpoRow, GrpoRun
from benchmarks.stats import MiB, fmt_count, fmt_held, header, panels, save_figure

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


def fmt_spread(values: list[float], scale: float = 1.0, fmt: str = "{:.0f}", unit: str = "") -> str:
    """' (min-max)' of several rounds' values, or nothing for one."""
    if len(values) < 2:
        return ""
    return f" ({fmt.format(min(values) * scale)}-{fmt.format(max(values) * scale)}{unit})"


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
        f"{sp[0] if sp else math.nan:.2f}x | {x_ddp} | "
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
        f"{b['reduce_scatter']:.0f} ms, all-reduce {b['all_reduce']:.0f} ms. The window's pair per step moves the "
        f"bytes of DDP's one all-reduce and costs {pair_over_all_reduce(run):.2f}x it here, before FSDP2's copies "
        "in and out; with beta > 0 a reference model resharded after its log-prob pass adds one all-gather per "
        "step that DDP, which replicates it, does not need (kept resident: none after step 1)."
    )


def write_report(results: GrpoResults, out: Path) -> str:
    """Write results.md and grpo_step_split.png into `out`; return the target summary."""
    images = {"grpo_step_split.png": "GRPO step split"}
    return stats.write_report(results, out, [write_table(results)], check_targets(results), images, plot_step_split)
