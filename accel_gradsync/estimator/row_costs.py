"""The bytes of one estimate row that a live run does not plan with, so planning has no formula
for them: what a rank sends, the sharded gradients it keeps, and its peak gradient memory.

N shard ranks, R replicas on an HSDP mesh, M micro-batches; a unit's numel, dtypes and reduce
bytes are the adapter's `Unit`s, the units held are the `Plan`'s. Collective counts, held bytes
and all-gathers come from planning itself (`costs`, `Plan`), as a live run counts them.
"""

from __future__ import annotations

import torch

from accel_gradsync.planning.units import ALL_REDUCE, Plan
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


def count_sent_bytes(plan: Plan, adapter: ModelAdapter, micro_batches: int, replicate: int) -> int:
    """Bytes one rank sends per optimizer step: ring reduce-scatter (N-1)/N of the unsharded
    gradient (M per unit, 1 for a unit whose sync is held), HSDP ring all-reduce 2(R-1)/R of the shard (M per
    unit, 1 for a unit whose sync or all-reduce only is held)."""
    held = {id(u) for u in plan.held}
    total = 0.0
    for u in adapter.units:
        n = u.shard_size
        rs = ar = micro_batches
        if id(u) in held:
            ar = 1
            rs = micro_batches if plan.held_sync == ALL_REDUCE else 1
        total += rs * u.collectives * u.reduce_bytes * (n - 1) / n
        if adapter.hsdp:
            total += ar * u.collectives * (u.reduce_bytes / n) * 2 * (replicate - 1) / replicate
    return int(total)


def find_sharded_dtype(adapter: ModelAdapter) -> torch.dtype:
    """dtype of the sharded parameters (and so of their sharded gradients): accelerate keeps
    trainable parameters in one dtype, fp32 whenever mixed precision is on."""
    return next((p.dtype for p in adapter.model.parameters() if p.requires_grad), torch.float32)


def count_sharded_grad_bytes(plan: Plan, adapter: ModelAdapter) -> int:
    """Sharded gradient bytes per rank that units syncing every micro-batch accumulate between
    micro-batches (about P/N x sizeof(sharded dtype) in per_micro_batch mode). An all-reduce
    hold's partial sums are sharded too, but counted in held bytes."""
    held = {id(u) for u in plan.held}
    size = find_sharded_dtype(adapter).itemsize
    return sum(u.sharded_numel * size for u in adapter.units if id(u) not in held)


def count_held_bytes_in_compute_dtype(plan: Plan) -> int:
    """The held gradients' bytes in the compute dtype, where the plan holds them in a wider reduce
    dtype (fp32 over bf16: the bf16 bytes `reduce_dtype=bf16` holds); 0 where it holds them so."""
    if plan.held_sync == ALL_REDUCE or not any(u.held_dtype.itemsize > u.compute_dtype.itemsize for u in plan.held):
        return 0
    return sum(u.numel * u.compute_dtype.itemsize for u in plan.held)


def count_peak_grad_bytes(plan: Plan, adapter: ModelAdapter) -> int:
    """Gradient bytes per rank at the worst moment of the first deferred micro-batch's backward:

    held bytes (every held unit's unsharded gradient, and kept params; for an HSDP all-reduce
    hold the sharded partial sums) + the sharded gradients (sharded param dtype) of the units
    that sync every micro-batch + the largest single-unit transient:
    - a held unit whose held dtype differs from the compute dtype (FSDP2 bf16 compute, fp32
      reduce): its compute-dtype gradient while `to_accumulated_grad_if_needed` casts it;
    - a unit that syncs: its unsharded gradient in compute dtype, plus its reduce-dtype copy
      when the dtypes differ, until the reduce-scatter returns.
    Activations, params and optimizer state are not gradients and are not counted."""
    held = {id(u) for u in plan.held}
    transient = 0
    for u in adapter.units:
        compute = u.numel * u.compute_dtype.itemsize
        if id(u) in held and plan.held_sync != ALL_REDUCE:
            transient = max(transient, compute if u.held_dtype != u.compute_dtype else 0)
            continue
        transient = max(transient, compute + (u.reduce_bytes if u.reduce_dtype != u.compute_dtype else 0))
    return plan.held_bytes() + count_sharded_grad_bytes(plan, adapter) + transient
