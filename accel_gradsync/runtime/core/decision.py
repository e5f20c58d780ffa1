"""What a plan is told as: the one decision line printed per model at bind and at every plan
change, and the warnings a plan earns once, when it is made.

The line states the costs the plan implies (collectives per optimizer step, bytes held) with
policies.py's counting functions, which `accel-gradsync estimate` uses too, so the two agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import ResolvedConfig, SyncMode
from accel_gradsync.planning.costs import (
    all_gathers_per_step,
    collectives_per_step,
    format_bytes,
    generation_all_gathers,
    generation_all_gathers_per,
    generation_cost,
    narrower_than_reduce,
)
from accel_gradsync.planning.reduce_dtype import FP32_HELD_MODES
from accel_gradsync.planning.residency import Residency
from accel_gradsync.planning.units import ALL_REDUCE, GRADIENT_SYNC, Level, Plan, Unit
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


def describe_decision(
    plan: Plan, adapter: ModelAdapter, micro_batches: int, generation: bool = True, counts_free: bool | None = None
) -> str:
    """One line: the mode, each unit's level, the collectives per optimizer step it implies and
    what it holds, gradients and params apart; then, with `generation`, what forwards without
    gradients (generation) all-gather, and hold with `gather_for_generation` (a loop of its own
    that has not generated leaves it out: `describe_generation` says it then). Frozen units count in the
    all-gathers (they reduce nothing). In a loop of `grad_sync.step(n)` (`counts_free` not None),
    what per-rank counts cost: nothing, or the replays padding would run. Where the policy gives a
    reason (auto's forecast or measurement, the memory it planned within), a second line (`WHY`)
    says it."""
    m = micro_batches
    plan = plan.over(m)
    rs, ar = collectives_per_step(plan, adapter.units, adapter.hsdp, m)
    every = sum(u.collectives for u in adapter.units) * m
    if adapter.collective == "all_reduce":
        cost = f"{rs} all-reduces/step instead of {every}"  # DDP: whole-model passes, bucketed
    else:
        ag, _ = all_gathers_per_step(plan, adapter, m)
        every_ag, _ = all_gathers_per_step(Plan(SyncMode.PER_MICRO_BATCH), adapter, m)
        if adapter.hsdp:
            cost = (
                f"{rs} reduce-scatters, {ar} all-reduces and {ag} all-gathers/step "
                f"instead of {every}, {every} and {every_ag}"
            )
        else:
            cost = f"{rs} reduce-scatters and {ag} all-gathers/step instead of {every} and {every_ag}"
    levels = [plan.level(u) for u in adapter.units]
    counts = ", ".join(f"{levels.count(lv)} {lv.replace('_', '-')}" for lv in _LEVELS[plan.held_sync] if lv in levels)
    line = f"grad sync: {plan.mode} over {m} micro-batch{'es' if m != 1 else ''} on {adapter.kind} ({counts}) -> {cost}"
    if plan.held:
        dtype = str(plan.held[0].held_dtype).removeprefix("torch.")
        what = "sharded partial" if plan.held_sync == ALL_REDUCE else "unsharded"
        line += f"; holds ~{format_bytes(plan.held_grad_bytes())} {what} {dtype} grads"
        if plan.windowed:
            line += " + " + _kept_params(plan)
        line += " per rank" + _summed_in(plan, adapter)
    elif m > 1 and narrower_than_reduce(adapter):
        unit = next(u for u in adapter.units if not u.frozen)
        line += (
            f"; deferring would sum gradients in {_name(unit.held_dtype)} ({adapter.kind}'s no_sync() holds the "
            f"compute dtype), below the {_name(unit.reduce_dtype)} each micro-batch is reduced in here"
        )
    elif plan.windowed:  # one micro-batch per step: no gradient to hold, the window is that micro-batch
        line += f"; keeps {_kept_params(plan)} per rank from each forward to its backward"
    resident = [u for u in adapter.units if u.resident]
    if resident:
        dtype = str(resident[0].compute_dtype).removeprefix("torch.")
        kept = format_bytes(sum(u.param_bytes for u in resident))
        line += f"; keeps ~{kept} unsharded {dtype} params of {len(resident)} frozen units for the run"
    if counts_free is not None:
        line += "; " + _per_rank_counts(counts_free, adapter.kind)
    if generation and adapter.collective != "all_reduce":
        line += "; " + _generation_cost(plan, adapter)
    if plan.reason:  # how the mode chose (auto's forecast or measurement, budget's room): a line of its own
        line += f"\n{WHY}{plan.reason}"
    return line


def describe_generation(name: str, plan: Plan, adapter: ModelAdapter) -> str:
    """One line at the first forward without gradients (generation, evaluation) of the model
    `name` in a loop of its own: what its decision line left out."""
    return f"grad sync: {name}: {_generation_cost(plan, adapter)}"


_FREE_WITH = {
    "fsdp2": "deferred with keep_params_unsharded, every unit windowed, makes them free",
    "ddp": "any deferral makes them free",
    "fsdp1": "FSDP1 all-gathers at every forward: use fsdp_version: 2 for free ones",
}


def _per_rank_counts(free: bool, kind: str) -> str:
    """What `grad_sync.step(n)`'s per-rank counts cost under the plans of the step
    (`Attachment.counts_are_free`)."""
    if free:
        return "per-rank micro-batch counts (step(n)) free: a step issues the same collectives whatever its count"
    return (
        "per-rank micro-batch counts (step(n)): a rank below the step's largest replays its last micro-batch x 0 "
        f"up to it, as padding would ({_FREE_WITH[kind]})"
    )


WHY = "grad sync:   why: "
"""Starts the second line of a decision, the reason its policy gives for the plan (`Plan.reason`)."""


def frozen_keeps(units: Sequence[Unit], gather_for_generation: bool) -> bool:
    """Whether a frozen (reference) model's units stay unsharded across a pass of forwards without
    gradients (`FrozenModel.keeps`): where it is one unit, as that costs no more peak than one of
    those forwards (it gathers the whole model anyway); wrapped per unit, keeping them all holds
    the whole unsharded model, which only `gather_for_generation` asks for. Binding and the
    estimate both decide with it."""
    return len(units) == 1 or gather_for_generation


def describe_frozen(
    name: str, model_name: str, adapter: ModelAdapter, keeps: bool, residency: Residency | None = None
) -> str:
    """One line for an FSDP2 model with no trainable parameter (a reference model): what its
    forwards without gradients all-gather, kept or not (`FrozenModel.keeps`), resident or not
    (`FrozenModel.resident`; a second line says why where a planned mode decided)."""
    units = adapter.units
    n = len(units)
    per_forward = generation_all_gathers_per(units, kept=False)
    dtype = _name(units[0].compute_dtype)
    size = format_bytes(sum(u.param_bytes for u in units))
    line = f"grad sync: reference model {name} ({model_name}, not trained, {_count(n, 'fsdp2 unit')}) -> "
    why = "" if residency is None else f"\n{WHY}{residency.reason}"
    if residency is not None and residency.resident:
        return line + (
            f"{_count(generation_all_gathers(units, 1, kept=True), 'all-gather')} at its first forward, then none: "
            f"kept unsharded for the whole run (~{size} unsharded {dtype} params per rank){why}"
        )
    if not per_forward:  # no unit reshards after forward (FSDP2's default for a root): nothing to keep
        first = generation_all_gathers(units, 1, kept=False)
        what = "its one unit, the root," if n == 1 else "its units"
        return (
            line
            + (
                f"{_count(first, 'all-gather')} at its first forward without gradients and none per forward after it: "
                f"FSDP2 leaves {what} unsharded after a forward (~{size} unsharded {dtype} params per rank)"
            )
            + why
        )
    if keeps:
        kept_by = "what one of its forwards gathers anyway" if n == 1 else "gather_for_generation"
        return (
            line
            + (
                f"{_count(generation_all_gathers_per(units, kept=True), 'all-gather')} per pass of forwards without "
                f"gradients (a step's log-prob pass) instead of {per_forward} per forward: kept unsharded until "
                f"training resumes (~{size} unsharded {dtype} params per rank, {kept_by})"
            )
            + why
        )
    return (
        line
        + (
            f"{_count(per_forward, 'all-gather')} per forward without gradients (gather_for_generation keeps its "
            f"units through a pass: ~{size} unsharded {dtype} params per rank)"
        )
        + why
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _summed_in(plan: Plan, adapter: ModelAdapter) -> str:
    """The dtype the held gradients are summed in over the window, and what it means beside
    per-micro-batch sync, which sums each micro-batch's reduced shard in the sharded params' dtype
    (fp32 under mixed precision; DDP: the param dtype, as deferral does)."""
    unit = next((u for u in plan.held if not u.frozen), None)
    if unit is None:
        return ""
    held, compute = unit.held_dtype, unit.compute_dtype
    if adapter.kind == "ddp" or held.itemsize >= 4:
        over = f" (the reduce dtype, over {_name(compute)} compute)" if compute.itemsize < held.itemsize else ""
        return f", summed in {_name(held)}{over} as per micro-batch sums them"
    fix = (
        "reduce_dtype=fp32 sums them in float32"
        if adapter.kind == "fsdp2"
        else f"{adapter.kind}'s no_sync() holds the compute dtype whatever the reduce dtype: per_micro_batch, "
        "or FSDP2 with reduce_dtype=fp32, sums in float32"
    )
    return (
        f", summed in {_name(held)}: it rounds more than per micro-batch, which sums reduced shards in the "
        f"params' float32 under mixed precision, so the gradients differ; {fix}"
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kept_params(plan: Plan) -> str:
    """The unsharded params the plan's windowed units keep, e.g. `~1.2 MiB unsharded bfloat16 params`."""
    dtype = str(plan.windowed[0].compute_dtype).removeprefix("torch.")
    return f"~{format_bytes(plan.held_param_bytes())} unsharded {dtype} params"


def _generation_cost(plan: Plan, adapter: ModelAdapter) -> str:
    """What generation all-gathers apart from training (`costs.generation_cost`), in words."""
    cost = generation_cost(plan, adapter.units)
    if cost.kept:
        dtype = str(adapter.units[0].compute_dtype).removeprefix("torch.")
        kept = format_bytes(plan.generation_bytes)
        return (
            f"generation {cost.first} all-gathers per round (gather_for_generation: ~{kept} "
            f"unsharded {dtype} params per rank while generating)"
        )
    line = f"generation {cost.per_token} all-gathers per token after its first forward's {cost.first}"
    if cost.per_token_in_window is not None:
        line += (
            f" outside a window; inside one (TRL generates in its first micro-batch) {cost.per_token_in_window} per "
            f"token, its first forward making the window's {cost.windowed_first} of the step (stats() counts them as "
            "generation's)"
        )
    return line


_LEVELS = {
    GRADIENT_SYNC: (Level.WINDOWED, Level.DEFERRED, Level.PER_MICRO_BATCH, Level.FROZEN),
    ALL_REDUCE: (Level.WINDOWED, Level.DEFER_ALL_REDUCE, Level.PER_MICRO_BATCH, Level.FROZEN),
}


def warn_about_plan(plan: Plan, adapter: ModelAdapter, settings: ResolvedConfig, micro_batches: int) -> None:
    """Warn about what a first plan costs or ignores on this wrapper. The warnings point at the
    code that called `bind` (`prepare`, the first `no_sync`, or attach)."""
    if settings.keep_params_unsharded and adapter.kind != "fsdp2" and plan.held:
        instead = {
            "fsdp1": "FSDP1's nearest equivalent is sharding_strategy SHARD_GRAD_OP",
            "ddp": "DDP never shards parameters",
        }[adapter.kind]
        warnings.warn(
            f"accel_gradsync: keep_params_unsharded does not apply on {adapter.kind}: it keeps FSDP2 units' "
            f"parameters unsharded through the accumulation window ({instead}).",
            GradSyncWarning,
            stacklevel=4,
        )
    if adapter.root_only and plan.held and any(not u.frozen and u not in plan.held for u in adapter.units):
        raise AssertionError(f"{adapter.kind} can only defer every unit at once")  # policies ensure it
    wide = [u for u in plan.held if u.held_dtype.itemsize > u.compute_dtype.itemsize]
    # auto and budget chose fp32 themselves, and attach and the decision line say so: not a surprise.
    chosen_by_mode = settings.sync_mode in FP32_HELD_MODES and settings.reduce_dtype == "auto"
    if plan.held_sync != ALL_REDUCE and wide and micro_batches > 1 and not chosen_by_mode:
        extra = sum(u.numel * (u.held_dtype.itemsize - u.compute_dtype.itemsize) for u in wide)
        warnings.warn(
            f"accel_gradsync: deferral holds gradients in {wide[0].held_dtype} (the reduce dtype), wider "
            f"than the {wide[0].compute_dtype} compute dtype: {format_bytes(extra)} more per rank than "
            f"{wide[0].compute_dtype} would hold. reduce_dtype=bf16 halves it, at the cost of summing the "
            "micro-batches in bf16 (the gradients then differ from per_micro_batch's).",
            GradSyncWarning,
            stacklevel=4,
        )
    _warn_low_precision_sums(plan, adapter, settings, micro_batches)


def _warn_low_precision_sums(plan: Plan, adapter: ModelAdapter, settings: ResolvedConfig, micro_batches: int) -> None:
    """Once per model: a plan that holds gradients (or `auto`, which may hold from step 2 on) on
    FSDP in a dtype narrower than fp32 sums the micro-batches in it, where per-micro-batch sync
    sums reduced shards in the params' dtype (fp32 under mixed precision). An explicit
    `reduce_dtype=bf16` is that choice made knowingly: the decision line says it, no warning."""
    if micro_batches < 2 or adapter.kind == "ddp" or settings.reduce_dtype == "bf16":
        return
    if plan.held:
        units, what = plan.held, "deferral"
    elif settings.sync_mode == SyncMode.AUTO and not narrower_than_reduce(adapter):
        units, what = adapter.units, "auto, from step 2 on where it defers,"
    else:
        return
    unit = next((u for u in units if not u.frozen and u.held_dtype.itemsize < 4), None)
    if unit is None:
        return
    low = str(unit.held_dtype).removeprefix("torch.")
    setting = "reduce_dtype: fp32 (--grad-sync-reduce-dtype fp32, ACCEL_GRADSYNC_REDUCE_DTYPE=fp32)"
    if adapter.kind != "fsdp2":
        fix = (
            f"{adapter.kind}'s no_sync() holds the compute dtype whatever the reduce dtype: use sync mode "
            f"per_micro_batch, or FSDP2 (fsdp_version: 2) with {setting}"
        )
    elif settings.sync_mode in FP32_HELD_MODES and settings.reduce_dtype == "auto":
        fix = (
            f"{settings.sync_mode} holds them in float32 by default, but the reduce dtype must reach FSDP before "
            "the model is wrapped: call accel_gradsync.attach() before accelerator.prepare()"
        )
    else:
        fix = f"set {setting} before accelerator.prepare() to sum them in float32, at twice the held bytes"
    warnings.warn(
        f"accel_gradsync: {what} sums the held gradients of {micro_batches} micro-batches in {low}, where "
        "per_micro_batch sums each one's reduced shard in the params' dtype (float32 under mixed precision): "
        f"the gradients differ (docs/modes.md measures it). To fix it, {fix}; reduce_dtype: bf16 keeps "
        f"{low} sums without this warning.",
        GradSyncWarning,
        stacklevel=5,
    )
