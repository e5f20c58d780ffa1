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
    """The human-readable table: a header line (with `--beta` the reference model's line, with
    frozen units to keep `keep_frozen_unsharded`'s), one row per mode, then the n/a reasons."""
    rows, notes = [], []
    kept = any(m.applicable and m.units_resident for m in est.modes)  # the column only where a row keeps some
    header = _HEADER + ([_KEPT_FROZEN] if kept else []) + ([_STEP_PEAK] if est.step_shape is not None else [])
    for m in est.modes:
        cells = _format_row(est, m) + ([_format_kept_frozen(m)] if kept else [])
        rows.append(cells + ([_format_step_peak(m)] if est.step_shape is not None else []))
        if not m.applicable:
            notes.append(f"{m.mode}: n/a: {m.reason}")
        elif m.reason:
            notes.append(f"{m.mode}: {m.reason}")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [_describe_launch(est), *([est.reference.line] if est.reference is not None else [])]
    lines += [*_describe_kept_frozen(est), ""]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines += ["", "* the mode GradSyncConfig selects", *notes, *_explain_kept_frozen(est)]
    lines += [*_explain_held_dtype(est), *_explain_step_peak(est)]
    return "\n".join(lines)


_KEPT_FROZEN = "kept frozen/rank"


def _format_kept_frozen(m: ModeEstimate) -> str:
    """The kept frozen cell: the units `keep_frozen_unsharded` keeps for the run and their bytes."""
    if not m.applicable or not m.units_resident:
        return "" if not m.applicable else "-"
    return f"{m.units_resident} ({format_bytes(m.resident_param_bytes)})"


def _describe_kept_frozen(est: Estimate) -> list[str]:
    """The header's `keep_frozen_unsharded` line, for the selected mode, in the words of its
    decision line (runtime/core/decision.py): which frozen units it keeps for the run."""
    if est.keep_frozen_unsharded is None:
        return []
    setting = f"grad sync: keep_frozen_unsharded={est.keep_frozen_unsharded}"
    selected = next((m for m in est.modes if m.selected), None)
    if selected is None or not selected.applicable:
        return [f"{setting}: the selected mode is n/a here (below)"]
    if not selected.units_resident:
        why = {
            "false": "",
            "true": " (one process: attach does nothing)",
            "auto": " (auto keeps them only where budget and auto plan memory, as their bytes fit)",
        }[est.keep_frozen_unsharded]
        if est.use_vllm:
            why = " (use_vllm: TRL's weight sync merges the adapter into the sharded base between steps)"
        return [
            f"{setting}: {selected.mode} keeps no frozen unit unsharded{why}; the frozen base is gathered every step"
        ]
    return [
        f"{setting}: {selected.mode} keeps ~{format_bytes(selected.resident_param_bytes)} unsharded "
        f"{selected.resident_dtype} params of {selected.units_resident} frozen units for the run "
        f"({_name_units(selected.resident_units)}); the adapters are units of their own, gathered every step"
    ]


def _explain_kept_frozen(est: Estimate) -> list[str]:
    """What the kept frozen column holds, and which units each row keeps."""
    rows = [m for m in est.modes if m.applicable and m.units_resident]
    if not rows:
        return []
    lines = [
        f"{_KEPT_FROZEN}: frozen units keep_frozen_unsharded keeps unsharded for the whole run, and their params "
        "(compute dtype), split from the adapters as a live prepare splits them and counted in the step peak; "
        "each is gathered once, at step 1's first forward: all-gathers/step counts the steps after it."
    ]
    for m in rows:
        lines.append(
            f"{m.mode}: keeps {_name_units(m.resident_units)}; step 1 all-gathers {m.first_step_all_gathers}, "
            f"each step after {m.all_gathers}"
        )
    return lines


def _name_units(names: list[str]) -> str:
    """Unit names with the layers of one list said once: `model.layers.0-27` (`0-3,5` where some
    are left out)."""
    groups: dict[str, list[int]] = {}
    out: list[str] = []
    for name in names:
        prefix, dot, index = name.rpartition(".")
        if dot and index.isdigit():
            if prefix not in groups:
                groups[prefix] = []
                out.append(prefix)
            groups[prefix].append(int(index))
        else:
            out.append(name)
    return ", ".join(f"{n}.{_ranges(groups[n])}" if n in groups else n for n in out)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> `0-2,5`."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


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
