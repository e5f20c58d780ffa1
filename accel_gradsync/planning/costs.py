"""Every count, byte and dtype formula: collectives and all-gathers per step, what generation
gathers, what a unit holds and in which dtype, the FSDP reduce dtype a mode asks for. The
decision line, the policies, the counters and the estimate all count through these."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from accel_gradsync.compat.fsdp2 import release as fsdp2_release
from accel_gradsync.config.settings import DTYPES
from accel_gradsync.planning.reduce_dtype import reduce_dtype_for
from accel_gradsync.planning.units import ALL_REDUCE, GRADIENT_SYNC, Level, Plan, Unit, Wrapped


def micro_batch_all_gathers(
    unit: Unit, gathered: bool, kept_through_forward: bool, kept_after_backward: bool
) -> tuple[int, bool]:
    """(parameter all-gathers, params still unsharded after) of one unit over one micro-batch's
    forward and backward: its forward gathers unless the params are still unsharded from before;
    its backward gathers again when the forward resharded them (`reshard_after_forward`, unless
    the unit is windowed: kept through this forward); after backward they stay only where the unit
    is windowed (or FSDP1 SHARD_GRAD_OP under `no_sync()` keeps them). The decision line, the estimate (through
    `step_all_gathers`) and FSDP1's live counters (runtime/core/accounting.py) count with it."""
    count = (0 if gathered else 1) + (1 if unit.reshards_after_forward and not kept_through_forward else 0)
    return count, kept_after_backward


def step_all_gathers(unit: Unit, micro_batches: int, kept_through_forward: bool, kept_between: bool) -> int:
    """Parameter all-gathers of one unit over an optimizer step of `micro_batches`, counted with
    `micro_batch_all_gathers` in constant time, so that any M answers at once: the first
    micro-batch starts sharded; every micro-batch between the first and the last finds the params
    as the one before left them (`kept_between`) and leaves them so, so they all gather alike; the
    last one's backward reshards. `kept_through_forward`: a windowed unit keeps its params through every
    forward; `kept_between`: they stay unsharded after every backward but the last (windowed, or
    FSDP1 SHARD_GRAD_OP under `no_sync()`)."""

    def one(gathered: bool, last: bool) -> tuple[int, bool]:
        return micro_batch_all_gathers(unit, gathered, kept_through_forward, kept_between and not last)

    if micro_batches == 1:
        return one(False, True)[0]
    first, gathered = one(False, False)
    between, _ = one(gathered, False)  # leaves the params as it found them
    last, _ = one(gathered, True)
    return first + (micro_batches - 2) * between + last


def counts_are_free(plan: Plan, wrapped: Wrapped) -> bool:
    """Whether ranks may run different numbers of micro-batches in one optimizer step with no
    collective added (`grad_sync.step(n)`): a step then issues the same collectives whatever its
    count. FSDP2: every unit windowed (all-gathered at the window's first forward, reduced at its
    last backward) or resident (gathered once per run); DDP: held at its root (`no_sync`: one
    all-reduce pass, at the last backward). FSDP1 all-gathers at every forward; HSDP's
    `defer_all_reduce` reduce-scatters every micro-batch."""
    if wrapped.kind == "ddp":
        return bool(plan.held)
    if wrapped.kind != "fsdp2" or plan.held_sync != GRADIENT_SYNC:
        return False
    windowed = {id(u) for u in plan.windowed}
    return all(id(u) in windowed or u.resident for u in wrapped.units)


def no_grad_forward_all_gathers(unit: Unit, gathered: bool, kept: bool) -> tuple[int, bool]:
    """(all-gathers, params still unsharded after) of one unit over a forward without gradients
    (generation, evaluation): no backward follows, so a unit that does not reshard after forward
    (FSDP2's root) or that is `kept` (`gather_for_generation`) stays unsharded."""
    return (0 if gathered else 1), kept or not unit.reshards_after_forward


def retained_grad_dtype(
    wrapper: str,
    param_dtype: torch.dtype,
    mp_param_dtype: torch.dtype | None = None,
    mp_reduce_dtype: torch.dtype | None = None,
    torch_release: str | None = None,
    grad_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """dtype of the unsharded gradient a unit holds between deferred micro-batches.

    Gradients are computed in the compute dtype (the mixed-precision `param_dtype`, else the
    parameter's own). FSDP2 holds them in `reduce_dtype` where the policy sets one (torch
    2.13/2.14 move a held gradient to `unsharded_accumulated_grad` cast to it, 2.15 casts it on
    the unsharded parameter), so bf16 params with an fp32 reduce hold 4 bytes/param. Without a
    `reduce_dtype`, torch 2.13/2.14 hold in the compute dtype and torch 2.15 in the parameter's
    `grad_dtype` (`grad_dtype`: its own dtype unless set; None, an explicit "any", gives the
    compute dtype), so fp32 params under a bf16 `param_dtype` hold 4 bytes/param on 2.15 and 2 on
    2.14. `torch_release` is the series whose rule applies (None: the running torch;
    `compat.fsdp2.release`). FSDP1's `no_sync()` and DDP keep the gradient in the compute dtype.
    """
    compute = mp_param_dtype or param_dtype
    if wrapper != "fsdp2":
        return compute
    if mp_reduce_dtype is not None:
        return mp_reduce_dtype
    if fsdp2_release(torch_release).grads_follow_grad_dtype:
        return grad_dtype or compute
    return compute


def unit_dtypes(
    wrapper: str,
    param_dtype: torch.dtype,
    mp_param_dtype: torch.dtype | None = None,
    mp_reduce_dtype: torch.dtype | None = None,
    torch_release: str | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(held, reduce, compute) dtypes of one unit's gradient. FSDP2 reduce-scatters what it holds
    (`retained_grad_dtype`: the reduce dtype, else the compute dtype up to torch 2.14 and the
    parameter's `grad_dtype` from 2.15); FSDP1 computes and holds in the compute dtype and reduces
    in its policy's `reduce_dtype`; DDP uses the parameter dtype throughout."""
    compute = mp_param_dtype or param_dtype
    held = retained_grad_dtype(wrapper, param_dtype, mp_param_dtype, mp_reduce_dtype, torch_release, grad_dtype)
    reduce = held if wrapper == "fsdp2" else (mp_reduce_dtype or compute)
    return held, reduce, compute


REDUCE_SCATTER_COST: dict[str, float] = {"gloo": 1.4}
"""The time one byte of reduce-scatter takes in a step against one byte of all-gather, FSDP2's
copies in and out included, by process-group backend (absent: 1). NCCL and HCCL run both as
rings over the same bytes. The gloo figure is measured by `python -m benchmarks.run`, which
checks it against its own run (docs/performance.md)."""


def collectives_per_step(plan: Plan, units: Sequence[Unit], hsdp: bool, micro_batches: int) -> tuple[int, int]:
    """(reduce-scatters, HSDP all-reduces) per optimizer step: every unit syncs on each of the M
    micro-batches, a held unit skips M-1 of them, an all-reduce hold skips only all-reduces."""
    m = micro_batches
    per_sync = sum(u.collectives for u in units)
    held = sum(u.collectives for u in plan.held)
    if plan.held_sync == ALL_REDUCE:
        return per_sync * m, per_sync * m - held * (m - 1)
    issued = per_sync * m - held * (m - 1)
    return issued, issued if hsdp else 0


def unit_all_gathers(unit: Unit, level: Level, micro_batches: int, keeps_params_when_held: bool = False) -> int:
    """Parameter all-gathers of one unit per optimizer step of `micro_batches` (`step_all_gathers`):
    one in each forward, another in each backward when it reshards after forward; a windowed unit
    gathers once per step (with one micro-batch too: its params stay from forward to backward); a
    resident one none after the run's first step.
    FSDP1 SHARD_GRAD_OP under `no_sync()` keeps params after a held backward: one gather per step too."""
    if unit.resident:
        return 0  # gathered once, at the run's first forward
    windowed = level == Level.WINDOWED
    keeps = windowed or (level == Level.DEFERRED and keeps_params_when_held)
    return step_all_gathers(unit, micro_batches, windowed, keeps)


def generation_all_gathers(units: Sequence[Unit], forwards: int, kept: bool) -> int:
    """Parameter all-gathers of `forwards` forwards without gradients (a generation round of
    that many tokens), from sharded units: with `kept` (`gather_for_generation`) each unit once,
    else each unit that reshards after forward once per forward."""
    count = 0
    for u in units:
        gathered = False
        for _ in range(forwards):
            n, gathered = no_grad_forward_all_gathers(u, gathered, kept)
            count += n
    return count


def generation_all_gathers_per(units: Sequence[Unit], kept: bool) -> int:
    """All-gathers generation costs: per round with `kept` (`gather_for_generation`, each unit
    once), else per token (each unit that reshards after forward)."""
    if kept:
        return generation_all_gathers(units, 1, kept=True)
    return generation_all_gathers(units, 2, kept=False) - generation_all_gathers(units, 1, kept=False)


@dataclass(frozen=True)
class GenerationCost:
    """What generation all-gathers apart from training under a plan, as `stats()` counts it
    (`generation_all_gathers`): its first forward gathers every unit; with its units kept
    (`gather_for_generation`, `kept`) nothing more that round, else each forward after it (each
    token, and each forward of TRL's no-grad log-prob passes) every unit that reshards after
    forward. Inside a window (TRL generates in a held micro-batch) the windowed units stay
    unsharded: the first forward makes the window's all-gathers of that step (`windowed_first`),
    which training then does not make, and each token gathers only the other units."""

    first: int
    per_token: int
    kept: bool
    per_token_in_window: int | None = None
    """None without windowed units."""
    windowed_first: int = 0


def generation_cost(plan: Plan, units: Sequence[Unit]) -> GenerationCost:
    """The `GenerationCost` of `plan` over `units` (the decision line and the estimate read it).
    Resident units (`keep_frozen_unsharded`) are unsharded for the run from its first forward on:
    after that one, generation gathers none of them."""
    units = [u for u in units if not u.resident]
    first = generation_all_gathers(units, 1, kept=False)
    if plan.generation_bytes:
        return GenerationCost(first, 0, kept=True)
    per_token = generation_all_gathers_per(units, kept=False)
    if not plan.windowed:
        return GenerationCost(first, per_token, kept=False)
    rest = [u for u in units if not any(u is w for w in plan.windowed)]
    return GenerationCost(
        first,
        per_token,
        kept=False,
        per_token_in_window=generation_all_gathers_per(rest, kept=False),
        windowed_first=generation_all_gathers(plan.windowed, 1, kept=False),
    )


def all_gathers_per_step(plan: Plan, adapter: Any, micro_batches: int) -> tuple[int, int]:
    """(all-gathers, bytes one rank sends for them) per optimizer step, over `adapter.units`.
    Ring: (N-1)/N of the unsharded params in the compute dtype per all-gather."""
    if adapter.collective == "all_reduce":
        return 0, 0  # DDP keeps whole params on every rank
    count, sent = 0, 0.0
    for u in adapter.units:
        n = unit_all_gathers(u, plan.level(u), micro_batches, adapter.keeps_params_when_held)
        count += n
        sent += n * u.param_bytes * (u.shard_size - 1) / u.shard_size
    return count, int(sent)


def narrower_than_reduce(adapter: Wrapped) -> bool:
    """True where deferring would sum gradients in a narrower dtype than per-micro-batch sync
    does: FSDP1's `no_sync()` keeps them in the compute dtype (bf16) whatever the reduce dtype,
    while syncing reduces each micro-batch in the reduce dtype (fp32) and sums the shards in fp32.
    FSDP2 holds in the reduce dtype itself, so this is never true there."""
    return any(u.held_dtype.itemsize < u.reduce_dtype.itemsize for u in adapter.units if not u.frozen)


def generation_bytes_of(adapter: Wrapped, config: Any) -> int:
    """Unsharded parameter bytes per rank `gather_for_generation` holds while generating: every
    FSDP2 unit's params in the compute dtype; 0 when the setting is off or does not apply."""
    if not config.gather_for_generation or adapter.kind != "fsdp2":
        return 0
    return sum(u.param_bytes for u in adapter.units)


def reduce_scatter_cost_of(adapter: Wrapped) -> float:
    """What a reduce-scatter byte weighs against an all-gather byte on the model's backend."""
    return REDUCE_SCATTER_COST.get(getattr(adapter, "backend", ""), 1.0)  # the estimate: a GPU/NPU cluster


def format_bytes(n: int) -> str:
    """Bytes for a message: exact below 1 KiB, else KiB, MiB or GiB with one decimal."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def reduce_dtype_policy(plugin: Any, reduce_dtype: str, mode: str) -> Any:
    """The FSDP mixed-precision policy accelerate's `plugin` is to wrap with in sync mode `mode`:
    its own with `reduce_dtype` written in, or fp32 where `reduce_dtype` is `auto`, the mode is
    `auto` or `budget` (`reduce_dtype.reduce_dtype_for`) and the policy computes in less than fp32 (it
    is there that per-micro-batch sync sums in the fp32 params and a bf16 hold would not). None
    where the policy stays as it is. The estimate builds its plugin with it too."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    policy = plugin.mixed_precision_policy
    dtype = reduce_dtype_for(mode, reduce_dtype)
    compute = getattr(policy, "param_dtype", None)
    if dtype == "auto" or reduce_dtype == "auto" and (compute is None or compute.itemsize >= DTYPES[dtype].itemsize):
        return None
    if policy is None:
        policy = MixedPrecisionPolicy() if plugin.fsdp_version == 2 else MixedPrecision()
    return dataclasses.replace(policy, reduce_dtype=DTYPES[dtype])
