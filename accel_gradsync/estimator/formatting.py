"""An `Estimate` as the CLI prints it: `format_table` (a header line, with `--beta` the reference
model's line, one row per mode, then the n/a reasons and what the held dtype means) or
`format_json` (every field of `Estimate.to_dict`).
Tests and docs quote the table: a change to a header or note shows in both.
"""

from __future__ import annotations

import json

from accel_gradsync.compat.fsdp2 import torch_series
from accel_gradsync.estimator.results import Estimate, ModeEstimate
from accel_gradsync.planning.costs import format_bytes

_HEADER = [
    "mode",
    "reduce-scatters/step",
    "all-reduces/step",
    "sent/rank/step",
    "held grads/rank",
    "held dtype",
    "held params/rank",
    "sharded grads/rank",
    "peak/rank",
    "fits",
    "all-gathers/step",
    "generation params/rank",
]


_STEP_PEAK = "step peak/rank"


def format_json(est: Estimate) -> str:
    """The estimate as JSON: `Estimate.to_dict()`, one-space indented."""
    return json.dumps(est.to_dict(), indent=1)


def format_table(est: Estimate) -> str:
    """The human-readable table: a header line, one row per mode, then the n/a reasons."""
    rows, notes = [], []
    header = _HEADER + ([_STEP_PEAK] if est.step_shape is not None else [])
    for m in est.modes:
        rows.append(_format_row(est, m) + ([_format_step_peak(m)] if est.step_shape is not None else []))
        if not m.applicable:
            notes.append(f"{m.mode}: n/a: {m.reason}")
        elif m.reason:
            notes.append(f"{m.mode}: {m.reason}")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [_describe_launch(est), *([est.reference.line] if est.reference is not None else []), ""]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines += ["", "* the mode GradSyncConfig selects", *notes, *_explain_held_dtype(est), *_explain_step_peak(est)]
    return "\n".join(lines)


def _format_step_peak(m: ModeEstimate) -> str:
    """The step peak cell: bytes and the phase it falls in; a '+' where a part is not modeled."""
    if not m.applicable or m.step_peak_bytes is None:
        return ""
    return f"{format_bytes(m.step_peak_bytes)} ({m.step_peak_phase})" + (" +" if m.step_peak_unmodeled else "")


def _explain_step_peak(est: Estimate) -> list[str]:
    """What the step peak column holds, and what it leaves out, row by row."""
    if est.step_shape is None:
        return []
    shape = est.step_shape
    lines = [
        f"{_STEP_PEAK}: the whole optimizer step's peak live bytes per rank for micro-batches of "
        f"{shape['micro_batch_size']} x {shape['seq_len']} tokens, {shape['optimizer']}, gradient checkpointing "
        f"{'on' if shape['gradient_checkpointing'] else 'off'}: sharded params, optimizer state, gradients "
        "(sharded and held), windowed/generation params and one micro-batch's activations, from torch's "
        "FSDPMemTracker on fake tensors (docs/estimate.md); in brackets the phase it falls in."
    ]
    reference = est.reference
    if reference is not None and reference.sharded_param_bytes:
        # Each row's mode decides residency (keep_reference_unsharded=auto: budget and auto, where it fits).
        rows = [m for m in est.modes if m.applicable]
        resident = [m.mode for m in rows if m.reference_resident]
        lines[0] += (
            f" With --beta, the reference model's {format_bytes(reference.sharded_param_bytes)} of sharded params"
        )
        if len(resident) == len(rows):
            lines[0] += " and all its unsharded params (kept resident) in every phase."
        elif resident:
            lines[0] += (
                f" in every phase, all its unsharded params too (kept resident) in {', '.join(resident)}, "
                "and in the other rows its log-prob pass as a phase (reference_pass)."
            )
        else:
            lines[0] += " in every phase, and its log-prob pass as a phase (reference_pass)."
    for m in est.modes:
        if m.applicable and m.step_peak_unmodeled:
            lines.append(f"{m.mode}: step peak +: not modeled: {'; '.join(m.step_peak_unmodeled)}")
    return lines


def _describe_launch(est: Estimate) -> str:
    """The table's first line: model, units, mesh, dtypes, micro-batches and free memory."""
    mesh = (
        f"{est.replicate_size} replicas x {est.shard_size} shards"
        if est.replicate_size > 1
        else f"{est.shard_size} shards"
    )
    if est.num_processes == 1:
        processes = "1 process (nothing to sync between ranks: attach does nothing, every mode runs the same)"
    else:
        processes = f"{est.num_processes} processes ({mesh})"
    return (
        f"model {est.model}: {est.params:,} trainable params in {len(est.units)} {est.wrapper} units "
        f"(sharded by {est.sharded_by}); {processes}; "
        f"mixed_precision={est.mixed_precision}, reduce_dtype={est.reduce_dtype}; "
        f"{est.micro_batches} micro-batches per optimizer step; {_describe_torch(est)}"
        + (f"; free memory {format_bytes(est.free_memory)}/rank" if est.free_memory is not None else "")
    )


def _describe_torch(est: Estimate) -> str:
    """Which torch's FSDP2 rules the rows follow, and this process's where it is another."""
    if torch_series(est.torch_running) == est.torch:
        return f"torch {est.torch} (this process's {est.torch_running})"
    return f"torch {est.torch}'s dtype rules (this process runs torch {est.torch_running})"


def _format_row(est: Estimate, m: ModeEstimate) -> list[str]:
    """One mode's cells, in `_HEADER`'s order; a mode that does not apply reads n/a."""
    name = m.mode + (" *" if m.selected else "")
    if not m.applicable:
        return [name, "n/a"] + [""] * (len(_HEADER) - 2)
    held = format_bytes(m.held_bytes)
    if m.held_bytes_compute_dtype:
        held += f" ({est.compute_dtype}: {format_bytes(m.held_bytes_compute_dtype)})"
    return [
        name,
        str(m.reduce_scatters),
        str(m.all_reduces) if est.replicate_size > 1 else "-",
        format_bytes(m.send_bytes),
        held,
        m.held_dtype or "-",
        format_bytes(m.held_param_bytes),
        format_bytes(m.sharded_bytes),
        format_bytes(m.peak_bytes),
        "-" if m.fits is None else ("yes" if m.fits else "NO"),
        f"{m.all_gathers} ({format_bytes(m.all_gather_bytes)})",
        format_bytes(m.generation_bytes) if m.generation_bytes else "-",
    ]


def _explain_held_dtype(est: Estimate) -> list[str]:
    """What the held dtype means, where the model computes in less than fp32: the dtype the held
    gradients of the micro-batches are summed in, beside per_micro_batch's fp32 sums."""
    if est.compute_dtype in ("", "fp32"):
        return []
    low = est.compute_dtype
    lines = [
        f"held dtype: what held gradients are summed in over the {est.micro_batches} micro-batches. fp32 sums "
        f"as per_micro_batch does (it sums reduced shards in the fp32 params); {low} sums round more, so "
        "the gradients differ (measured in docs/modes.md)."
    ]
    if est.wrapper == "fsdp2":
        lines.append(
            f"auto and budget hold fp32 where the model computes in {low} (reduce_dtype auto; in brackets the "
            f"{low} bytes reduce_dtype=bf16 holds instead); the other modes keep accelerate's reduce dtype unless "
            "reduce_dtype is fp32."
        )
    else:
        lines.append(
            f"{est.wrapper}'s no_sync() holds the compute dtype whatever the reduce dtype: auto defers only with "
            "reduce_dtype=bf16; FSDP2 with reduce_dtype fp32 holds fp32."
        )
    return lines
