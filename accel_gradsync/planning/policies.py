"""Sync policies: which FSDP units hold their gradient sync on a micro-batch that is not the last.

One small class per mode, looked up by name in `POLICIES`; a mode adds a class there. A policy
only decides, once per model and before the first step, producing a frozen `Plan`;
runtime/integration/bind.py asks for it and runtime/accumulation/window.py applies it on every micro-batch. The last
micro-batch of every optimizer step syncs every unit, whatever the plan says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from accel_gradsync.config.settings import ResolvedConfig, SyncMode, dtype_name
from accel_gradsync.planning.costs import (
    format_bytes,
    generation_bytes_of,
    narrower_than_reduce,
    reduce_scatter_cost_of,
    unit_all_gathers,
)
from accel_gradsync.planning.units import ALL_REDUCE, Level, Plan, Unit, Wrapped

FreeMemory = Callable[[], int]
"""Free device bytes per rank, the minimum over ranks (measured once, on demand)."""


class SyncPolicy:
    """Base class: plan which units hold their sync for one wrapped model."""

    name: str = ""
    description: str = ""
    needs_fsdp2: str = ""
    """What of FSDP2's the mode sets per unit, where FSDP1 and DDP have only the root's
    `no_sync()`; empty: the mode runs on every wrapper."""
    needs_hsdp: bool = False
    """True when the mode needs a mesh with a replicate dimension (HSDP)."""

    def __init__(self, config: ResolvedConfig) -> None:
        assert isinstance(config, ResolvedConfig), type(config)  # resolved once, at attach or the estimate
        self.config = config

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        """The plan for `adapter`'s model. `reserved`: unsharded param bytes per rank other models
        keep while it generates, beyond what one of their forwards gathers anyway (a reference model
        kept per unit: `FrozenModel.kept_bytes`); the policies that plan within memory (budget,
        auto) take it off what they may hold, the others hold what they hold regardless."""
        raise NotImplementedError


def check_wrapper(mode: str, wrapper: str, hsdp: bool) -> None:
    """Raise `ValueError`, naming what to change, when sync mode `mode` cannot run on `wrapper`
    ("fsdp2", "fsdp1" or "ddp"), or without an HSDP mesh. Binding checks the wrapped model; a
    launcher can check the accelerate config with it before the model is loaded."""
    policy = POLICIES[mode]
    if policy.needs_fsdp2 and wrapper != "fsdp2":
        raise ValueError(
            f"sync mode '{mode}' needs FSDP2 ({policy.needs_fsdp2}), but the model is wrapped in {wrapper}. "
            "Use fsdp_version: 2 in the accelerate config (e.g. accelerate_configs/fsdp2.yaml), or sync mode "
            "'deferred' or 'per_micro_batch'."
        )
    if policy.needs_hsdp and not hsdp:
        raise ValueError(
            f"sync mode '{mode}' needs an HSDP mesh with a replicate dimension, but the model is sharded over a "
            "1-D mesh. Set parallelism_config dp_replicate_size > 1 in the accelerate config (e.g. "
            "accelerate_configs/hsdp.yaml), or use sync mode 'deferred'."
        )


class PerMicroBatchSync(SyncPolicy):
    """Reduce-scatter every unit after every micro-batch: M x U collectives per optimizer step,
    gradients stay sharded. FSDP2: `requires_gradient_sync` stays True; FSDP1/DDP: no `no_sync()`."""

    name = SyncMode.PER_MICRO_BATCH
    description = "reduce-scatter after every micro-batch (sharded grads, lowest memory)"

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        return Plan(self.name, generation_bytes=generation_bytes_of(adapter, self.config))


class DeferredSync(SyncPolicy):
    """Skip every unit's reduce-scatter until the last micro-batch: U collectives per step, but
    each rank holds the whole unsharded gradient between micro-batches. FSDP2:
    `set_requires_gradient_sync(False)`; FSDP1/DDP: root `no_sync()`.

    With `keep_params_unsharded` (FSDP2) every unit is windowed: its params stay unsharded from
    the window's first forward to its last backward (`set_reshard_after_forward(False)` and
    `set_reshard_after_backward(False)` until then), so it all-gathers once per optimizer step
    instead of up to 2M times; ZeRO-1 memory inside the window, fully sharded again before the
    optimizer step. FSDP1's nearest equivalent is the SHARD_GRAD_OP sharding strategy."""

    name = SyncMode.DEFERRED
    description = "reduce-scatter once per optimizer step (unsharded grads held)"

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        windows = self.config.keep_params_unsharded and adapter.kind == "fsdp2"
        # Frozen units have nothing to hold; they are held only to be windowed (they all-gather).
        held = [u for u in adapter.units if windows or not u.frozen]
        generation = generation_bytes_of(adapter, self.config)
        return Plan(self.name, held, windowed=held if windows else [], generation_bytes=generation)


class BudgetSync(SyncPolicy):
    """FSDP2 only: give each unit the level (per micro-batch, deferred, windowed) that saves the
    most bytes of communication within the budget (`choose_levels`), applied per unit with
    `set_requires_gradient_sync(False, recurse=False)` and the reshard setters."""

    name = SyncMode.BUDGET
    description = "defer (and keep unsharded) only the units whose held bytes fit a memory budget"
    needs_fsdp2 = "per-unit requires_gradient_sync"

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        check_wrapper(self.name, adapter.kind, adapter.hsdp)
        budget = budget_bytes(self.config, free_memory)
        generation = generation_bytes_of(adapter, self.config)
        plan = choose_levels(
            self.name, adapter.units, budget - reserved, micro_batches, reduce_scatter_cost_of(adapter), generation
        )
        reason = (
            f"{_level_counts(plan, adapter.units)} within the {format_bytes(budget)} budget "
            f"({format_bytes(plan.held_bytes())} held"
            + (f", {format_bytes(generation)} of params while generating" if generation else "")
            + (f", {kept_elsewhere(reserved, adapter)}" if reserved else "")
            + ")"
        )
        return replace(plan, reason=reason)


def kept_elsewhere(reserved: int, adapter: Wrapped) -> str:
    """What `reserved` (`SyncPolicy.plan`) holds, in words: the model's own frozen units kept for
    the run (`keep_frozen_unsharded`, `Unit.resident`), the rest reference models'."""
    own = sum(u.param_bytes for u in adapter.units if u.resident)
    parts = [f"{format_bytes(reserved - own)} kept by reference models"] if reserved > own else []
    parts += [f"{format_bytes(own)} of frozen units kept unsharded"] if own else []
    return ", ".join(parts)


def budget_bytes(settings: ResolvedConfig, free_memory: FreeMemory) -> int:
    """Budget mode's bytes per rank: the absolute budget, or its fraction of `free_memory()`."""
    assert settings.memory_budget is not None  # GradSyncConfig refuses budget mode without one
    return settings.memory_budget.of(free_memory)


def choose_levels(
    mode: str,
    units: Sequence[Unit],
    budget: int,
    micro_batches: int,
    reduce_scatter_cost: float = 1.0,
    generation_bytes: int = 0,
) -> Plan:
    """The per-unit levels that save the most communication while holding at most `budget` bytes
    per rank. Deferring a unit saves M-1 reduce-scatters of its gradient; windowing it saves all
    its all-gathers but one. Bytes saved are counted as all-gather bytes: a reduce-scatter byte
    weighs `reduce_scatter_cost` (the backend's, `REDUCE_SCATTER_COST`).

    Greedy by bytes saved per byte a level adds over per-micro-batch (the order of the fractional
    knapsack), first fit within the budget of held bytes. Deferral adds the unsharded gradient
    less the sharded one FSDP2 no longer keeps through the window (1/N of it); windowing adds the
    unsharded params. A unit whose windowing pays more per byte than its deferral is offered both
    at once. A frozen unit has only its windowing to offer (it all-gathers like the others).

    `generation_bytes` (what `gather_for_generation` holds while generating) comes off the budget
    first; windowing then adds nothing, since generation holds every unit's params already."""
    m = micro_batches
    if m <= 1:
        return Plan(mode, generation_bytes=generation_bytes)  # one micro-batch per step: nothing to hold
    # Generation keeps every unit's params unsharded anyway (`generation_bytes`): those bytes come
    # off the budget first, and windowing then holds nothing generation does not already hold.
    budget -= generation_bytes
    offers = []  # (bytes saved per byte added, bytes held, unit, level reached, prerequisite level)
    for u in units:
        deferral = reduce_scatter_cost * (m - 1) * u.collectives * u.reduce_bytes
        windowing = (unit_all_gathers(u, Level.DEFERRED, m) - 1) * u.param_bytes
        param_cost = 0 if generation_bytes else u.param_bytes
        if u.frozen:  # nothing to defer: only its windowing saves anything
            if windowing > 0:
                offers.append((windowing / max(param_cost, 1), param_cost, u, Level.WINDOWED, Level.PER_MICRO_BATCH))
            continue
        added = max(u.held_bytes * (u.shard_size - 1) // u.shard_size, 1)  # unsharded only on one rank: free
        offers.append((deferral / added, u.held_bytes, u, Level.DEFERRED, Level.PER_MICRO_BATCH))
        if windowing > 0:
            offers.append((windowing / max(param_cost, 1), param_cost, u, Level.WINDOWED, Level.DEFERRED))
            both = u.held_bytes + param_cost
            offers.append(
                ((deferral + windowing) / (added + param_cost), both, u, Level.WINDOWED, Level.PER_MICRO_BATCH)
            )
    levels: dict[int, Level] = {}
    used = 0
    for _, cost, unit, level, needs in sorted(offers, key=lambda o: (o[0], o[1]), reverse=True):
        if levels.get(id(unit), Level.PER_MICRO_BATCH) == needs and used + cost <= budget:
            levels[id(unit)] = level
            used += cost
    held = [u for u in units if id(u) in levels]
    windowed = [u for u in held if levels[id(u)] == Level.WINDOWED]
    return Plan(mode, held, windowed=windowed, generation_bytes=generation_bytes)


class DeferAllReduceSync(SyncPolicy):
    """HSDP (replicate x shard mesh) only: reduce-scatter every micro-batch, so gradients stay
    sharded, and skip only the all-reduce across replicas until the last one
    (`set_requires_all_reduce(False)`), as torchtitan does."""

    name = SyncMode.DEFER_ALL_REDUCE
    description = "HSDP: reduce-scatter every micro-batch, all-reduce across replicas once per step"
    needs_fsdp2 = "set_requires_all_reduce"
    needs_hsdp = True

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        check_wrapper(self.name, adapter.kind, adapter.hsdp)
        trainable = [u for u in adapter.units if not u.frozen]
        return Plan(
            self.name, trainable, held_sync=ALL_REDUCE, generation_bytes=generation_bytes_of(adapter, self.config)
        )


class AutoSync(SyncPolicy):
    """The most communication-saving plan that fits memory: `plan_within` the usable bytes.

    At run time `attach` measures instead of reading free memory (accel_gradsync/planning/replan.py):
    step 1 syncs every micro-batch while the peak is measured, and the plan fits
    `capacity x (1 - margin) - peak`. This policy's own `plan` is that decision for a given free
    memory, which is what the estimate shows before launch."""

    name = SyncMode.AUTO
    description = (
        "the most communication-saving levels that fit measured memory (FSDP2), "
        "else defer_all_reduce (HSDP), else per_micro_batch"
    )

    def plan(self, adapter: Wrapped, free_memory: FreeMemory, micro_batches: int, reserved: int = 0) -> Plan:
        free = free_memory()
        usable = int(free * (1 - self.config.memory_margin))
        choice = plan_within(adapter, usable - reserved, micro_batches, generation_bytes_of(adapter, self.config))
        full = Plan(self.name, [u for u in adapter.units if not u.frozen])
        reason = (
            f"auto chose {_level_counts(choice, adapter.units)}: full deferral holds "
            f"{format_bytes(full.held_bytes())}/rank, {format_bytes(usable)} usable of {format_bytes(free)} free "
            f"(margin {self.config.memory_margin:g})"
            + (f", of it {kept_elsewhere(reserved, adapter)}" if reserved else "")
            + f"; the plan holds {format_bytes(choice.held_bytes())}"
        )
        if narrower_than_reduce(adapter):
            unit = next(u for u in adapter.units if not u.frozen)
            reason += (
                f"; {adapter.kind} would hold deferred gradients in {dtype_name(unit.held_dtype)}, below the "
                f"{dtype_name(unit.reduce_dtype)} reduce dtype, so auto does not defer (reduce_dtype=bf16 lets it)"
            )
        return replace(choice, reason=reason)


def plan_within(adapter: Wrapped, usable: int, micro_batches: int, generation_bytes: int = 0) -> Plan:
    """The plan that saves the most communication while holding at most `usable` bytes per rank
    (`generation_bytes`, held while generating, included). FSDP2: the levels `choose_levels`
    picks; on an HSDP mesh where not every unit fits that way, full deferral without windows if it
    fits, else only the all-reduce deferred. FSDP1/DDP: full deferral if it fits, else per
    micro-batch; per micro-batch too where their `no_sync()` would hold gradients in a narrower
    dtype than they are reduced in (`narrower_than_reduce`)."""
    g = generation_bytes
    full = Plan(SyncMode.AUTO, [u for u in adapter.units if not u.frozen], generation_bytes=g)
    if adapter.kind == "fsdp2":
        choice = choose_levels(SyncMode.AUTO, adapter.units, usable, micro_batches, reduce_scatter_cost_of(adapter), g)
        if adapter.hsdp and any(not u.frozen and u not in choice.held for u in adapter.units):
            # The greedy counts no all-reduce savings: deferring every unit's all-reduce (or its
            # whole sync, without windows, where that fits) beats holding only some units.
            all_reduce = Plan(SyncMode.AUTO, list(full.held), held_sync=ALL_REDUCE, generation_bytes=g)
            choice = full if full.held_bytes() + g <= usable else all_reduce
    elif narrower_than_reduce(adapter):
        choice = Plan(SyncMode.AUTO, generation_bytes=g)  # deferral would sum below the reduce dtype
    else:
        choice = full if full.held_bytes() + g <= usable else Plan(SyncMode.AUTO, generation_bytes=g)
    if choice.held_grad_bytes() + max(choice.held_param_bytes(), g) > usable:
        choice = Plan(SyncMode.AUTO, generation_bytes=g)
    return replace(choice, mode=mode_of(choice, adapter.units))


def mode_of(plan: Plan, units: Sequence[Unit]) -> str:
    """The plain mode a plan amounts to: `per_micro_batch`, `deferred`, `defer_all_reduce`, or
    `budget` for a mix of levels (frozen units, which reduce nothing, do not count)."""
    trainable = [u for u in units if not u.frozen]
    held = [u for u in plan.held if not u.frozen]
    if not held and not plan.windowed:
        return SyncMode.PER_MICRO_BATCH
    if plan.held_sync == ALL_REDUCE:
        return SyncMode.DEFER_ALL_REDUCE
    return SyncMode.DEFERRED if len(held) == len(trainable) else SyncMode.BUDGET


def _level_counts(plan: Plan, units: Sequence[Unit]) -> str:
    """e.g. `2 windowed, 1 deferred, 0 per micro-batch` (units at each level; `, 2 frozen` where
    frozen units are not windowed)."""
    levels = [plan.level(u) for u in units]
    frozen = f", {levels.count(Level.FROZEN)} frozen" if Level.FROZEN in levels else ""
    per_micro_batch = f"{levels.count(Level.PER_MICRO_BATCH)} per micro-batch"
    if plan.held_sync == ALL_REDUCE:
        return f"{levels.count(Level.DEFER_ALL_REDUCE)} defer_all_reduce, {per_micro_batch}{frozen}"
    return (
        f"{levels.count(Level.WINDOWED)} windowed, {levels.count(Level.DEFERRED)} deferred, {per_micro_batch}{frozen}"
    )


POLICIES: dict[str, type[SyncPolicy]] = {
    p.name: p for p in (PerMicroBatchSync, DeferredSync, BudgetSync, DeferAllReduceSync, AutoSync)
}


def resolve_policy(settings: ResolvedConfig) -> SyncPolicy:
    """The policy resolved settings select."""
    try:
        return POLICIES[settings.sync_mode](settings)
    except KeyError:
        raise ValueError(
            f"GradSyncConfig selects sync mode {settings.sync_mode!r}; valid choices: {', '.join(POLICIES)}."
        ) from None
