"""What a plan is told as: the one decision line printed per model at bind and at every plan
change, and the warnings a plan earns once, when it is made.

The line states the costs the plan implies (collectives per optimizer step, bytes held) with
policies.py's counting functions, which `accel-gradsync estimate` uses too, so the two agree.
"""

from __future__ import annotations

import warnings

from .config import GradSyncConfig, SyncMode
from .errors import GradSyncWarning
from .fsdp import ModelAdapter
from .policies import (
    ALL_REDUCE,
    GRADIENT_SYNC,
    Plan,
    all_gathers_per_step,
    collectives_per_step,
    format_bytes,
    generation_all_gathers_per,
)
from .units import Level


def describe_decision(plan: Plan, adapter: ModelAdapter, micro_batches: int) -> str:
    """One line: the mode, each unit's level, the collectives per optimizer step it implies and
    what it holds, gradients and params apart; then what forwards without gradients
    (generation) all-gather, and hold with `gather_for_generation`. Frozen units count in the
    all-gathers (they reduce nothing)."""
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
        line += " per rank"
    elif plan.windowed:  # one micro-batch per step: no gradient to hold, the window is that micro-batch
        line += f"; keeps {_kept_params(plan)} per rank from each forward to its backward"
    if adapter.collective != "all_reduce":
        line += "; " + _generation_cost(plan, adapter)
    if plan.reason:
        line += f" [{plan.reason}]"
    return line


def _kept_params(plan: Plan) -> str:
    """The unsharded params the plan's windowed units keep, e.g. `~1.2 MiB unsharded bfloat16 params`."""
    dtype = str(plan.windowed[0].compute_dtype).removeprefix("torch.")
    return f"~{format_bytes(plan.held_param_bytes())} unsharded {dtype} params"


def _generation_cost(plan: Plan, adapter: ModelAdapter) -> str:
    """What generation all-gathers apart from training: once per unit per round when its units
    are kept unsharded (`gather_for_generation`), else every resharding unit on every token."""
    units = adapter.units
    if plan.generation_bytes:
        dtype = str(units[0].compute_dtype).removeprefix("torch.")
        return (
            f"generation {generation_all_gathers_per(units, kept=True)} all-gathers per round "
            f"(gather_for_generation: ~{format_bytes(plan.generation_bytes)} unsharded {dtype} params per rank "
            "while generating)"
        )
    return f"generation {generation_all_gathers_per(units, kept=False)} all-gathers per token"


_LEVELS = {
    GRADIENT_SYNC: (Level.WINDOWED, Level.DEFERRED, Level.PER_MICRO_BATCH, Level.FROZEN),
    ALL_REDUCE: (Level.WINDOWED, Level.DEFER_ALL_REDUCE, Level.PER_MICRO_BATCH, Level.FROZEN),
}


def warn_about_plan(plan: Plan, adapter: ModelAdapter, config: GradSyncConfig, micro_batches: int) -> None:
    """Warn about what a first plan costs or ignores on this wrapper. The warnings point at the
    code that called `bind` (`prepare`, the first `no_sync`, or attach)."""
    if config.keep_params_unsharded and adapter.kind != "fsdp2" and plan.held:
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
    if plan.held_sync != ALL_REDUCE and wide and micro_batches > 1:
        extra = sum(u.numel * (u.held_dtype.itemsize - u.compute_dtype.itemsize) for u in wide)
        warnings.warn(
            f"accel_gradsync: deferral holds gradients in {wide[0].held_dtype} (the reduce dtype), wider "
            f"than the {wide[0].compute_dtype} compute dtype: {format_bytes(extra)} more per rank than "
            f"{wide[0].compute_dtype} would hold. Set reduce_dtype to match the params (or 'auto') to "
            "halve it, at the cost of reducing in low precision.",
            GradSyncWarning,
            stacklevel=4,
        )
