"""`planning.costs`: the closed-form all-gather counts equal a micro-batch by micro-batch walk
written here from what FSDP does, and a few counts worked out by hand."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from accel_gradsync.planning.costs import counts_are_free, generation_cost, unit_all_gathers
from accel_gradsync.planning.units import ALL_REDUCE, GRADIENT_SYNC, Level, Plan, Unit


def _walked_all_gathers(unit, level, m, keeps_params_when_held):
    """A step's all-gathers walked micro-batch by micro-batch from what FSDP does, not with the
    package's functions: a forward gathers the params unless the micro-batch before left them
    unsharded; its backward gathers them again when the forward freed them (a unit that reshards
    after forward, unless a window keeps them through it); after a backward they stay unsharded
    only where the micro-batch holds its sync (every one but the step's last, under a held level)
    and a window, or FSDP1 SHARD_GRAD_OP's no_sync, keeps them."""
    held = level in (Level.DEFERRED, Level.WINDOWED, Level.DEFER_ALL_REDUCE)
    windowed = level == Level.WINDOWED
    count, unsharded = 0, False
    for k in range(m):
        count += 0 if unsharded else 1  # forward
        count += 1 if unit.reshards_after_forward and not windowed else 0  # backward
        unsharded = held and k < m - 1 and (windowed or keeps_params_when_held)
    return count


@pytest.mark.parametrize("reshards", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_all_gathers_in_closed_form_equal_the_walk(reshards, frozen):
    unit = Unit("layer", torch.nn.Linear(2, 2), 0 if frozen else 6, 0 if frozen else 1, param_numel=6)
    unit = dataclasses.replace(unit, reshards_after_forward=reshards)
    for level in Level:
        # Only FSDP1 keeps params after a held backward (SHARD_GRAD_OP); it has no all-reduce hold.
        for keeps in (False, True) if level != Level.DEFER_ALL_REDUCE else (False,):
            for m in range(1, 7):
                assert unit_all_gathers(unit, level, m, keeps) == _walked_all_gathers(unit, level, m, keeps), (
                    level,
                    keeps,
                    m,
                )


def test_all_gathers_worked_out_by_hand():
    """A Block that reshards after forward, over M = 4: two per micro-batch (forward, backward)
    syncing or deferred; one per step windowed; with FSDP1 SHARD_GRAD_OP's no_sync keeping params
    after each held backward, one forward gather, then a backward gather per micro-batch. A root
    (no reshard after forward): one per micro-batch, one per step windowed."""
    block = Unit("block", torch.nn.Linear(2, 2), 6, 1, reshards_after_forward=True)
    root = Unit("", torch.nn.Linear(2, 2), 6, 1)
    assert [unit_all_gathers(block, level, 4) for level in ("per_micro_batch", "deferred", "windowed")] == [8, 8, 1]
    assert unit_all_gathers(block, Level.DEFERRED, 4, keeps_params_when_held=True) == 1 + 4
    assert [unit_all_gathers(root, level, 4) for level in ("per_micro_batch", "deferred", "windowed")] == [4, 4, 1]
    assert unit_all_gathers(block, Level.WINDOWED, 1) == 1  # kept from its forward to its backward


@pytest.mark.parametrize("level", [Level.PER_MICRO_BATCH, Level.WINDOWED, Level.FROZEN])
def test_a_resident_unit_gathers_nothing_per_step(level):
    """keep_frozen_unsharded: a frozen unit that never reshards was gathered at the run's first
    forward; a step of any M gathers it no more (a resharding one: twice per micro-batch)."""
    resident = Unit("layer", torch.nn.Linear(2, 2), 0, 0, param_numel=6, resident=True)
    resharding = dataclasses.replace(resident, resident=False, reshards_after_forward=True)
    for m in (1, 4):
        assert unit_all_gathers(resident, level, m) == 0
    assert unit_all_gathers(resharding, Level.FROZEN, 4) == 8


@pytest.mark.parametrize(
    ("kind", "held", "windowed", "held_sync", "free"),
    [
        # FSDP2: free only where every unit keeps its params through the window (or for the run).
        ("fsdp2", ("block", "root"), ("block", "root"), GRADIENT_SYNC, True),
        ("fsdp2", ("block", "root"), ("block",), GRADIENT_SYNC, False),  # the root re-gathers each forward
        ("fsdp2", ("block", "root"), (), GRADIENT_SYNC, False),  # deferred: all-gathers every micro-batch
        ("fsdp2", (), (), GRADIENT_SYNC, False),  # per micro-batch: reduce-scatters every micro-batch
        ("fsdp2", ("block", "root"), ("block", "root"), ALL_REDUCE, False),  # HSDP: reduce-scatters each
        # DDP: no_sync at the root makes every micro-batch but the last silent.
        ("ddp", ("block", "root"), (), GRADIENT_SYNC, True),
        ("ddp", (), (), GRADIENT_SYNC, False),
        # FSDP1 all-gathers at every forward, held or not.
        ("fsdp1", ("block", "root"), ("block", "root"), GRADIENT_SYNC, False),
    ],
)
def test_uneven_counts_are_free_only_where_no_micro_batch_between_first_and_last_issues_a_collective(
    kind, held, windowed, held_sync, free
):
    units = {
        "block": Unit("block", torch.nn.Linear(2, 2), 6, 1, reshards_after_forward=True),
        "root": Unit("", torch.nn.Linear(2, 2), 6, 1),
    }
    plan = Plan("m", [units[u] for u in held], held_sync, [units[u] for u in windowed])
    wrapped = SimpleNamespace(kind=kind, units=list(units.values()))
    assert counts_are_free(plan, wrapped) is free


def test_a_resident_frozen_unit_keeps_uneven_counts_free():
    trained = Unit("adapter", torch.nn.Linear(2, 2), 6, 1, reshards_after_forward=True)
    base = Unit("base", torch.nn.Linear(2, 2), 0, 0, param_numel=6, reshards_after_forward=True)
    plan = Plan("windowed", [trained], GRADIENT_SYNC, [trained])
    assert not counts_are_free(plan, SimpleNamespace(kind="fsdp2", units=[trained, base]))  # gathered each forward
    kept = dataclasses.replace(base, resident=True)
    assert counts_are_free(plan, SimpleNamespace(kind="fsdp2", units=[trained, kept]))


def test_generation_gathers_no_resident_unit():
    """A unit kept for the run (keep_frozen_unsharded) is unsharded when generation starts: its
    forwards gather only the others, one each per token where they reshard after forward."""
    adapter = Unit("adapter", torch.nn.Linear(2, 2), 6, 1, reshards_after_forward=True)
    base = Unit("base", torch.nn.Linear(2, 2), 0, 0, param_numel=6, reshards_after_forward=True)
    kept = dataclasses.replace(base, resident=True)
    assert (
        generation_cost(Plan("m"), [adapter, base]).first,
        generation_cost(Plan("m"), [adapter, base]).per_token,
    ) == (2, 2)
    assert (
        generation_cost(Plan("m"), [adapter, kept]).first,
        generation_cost(Plan("m"), [adapter, kept]).per_token,
    ) == (1, 1)
