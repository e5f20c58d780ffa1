"""How `budget` and `auto` rank the levels of a unit, per byte each adds over
per-micro-batch. Deferral saves reduce-scatter bytes and adds the unsharded gradient less the
sharded one (half of it on 2 ranks); a window saves all-gather bytes and adds the params. On gloo
a reduce-scatter byte takes about 1.4x an all-gather byte, so the same budget buys deferral of more
units there and a window with NCCL."""

import pytest
from torch import nn

from accel_gradsync.planning.costs import REDUCE_SCATTER_COST, reduce_scatter_cost_of
from accel_gradsync.planning.policies import choose_levels
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter

BLOCK = 1000  # elements: 4000 B of fp32 gradient and 4000 B of fp32 params per unit


def _units(n=3):
    return [Unit(f"blocks.{i}", nn.Identity(), BLOCK, 1, shard_size=2, reshards_after_forward=True) for i in range(n)]


def test_bytes_alone_window_one_unit_before_deferring_another():
    units = _units()
    # NCCL/HCCL weigh both alike: a window saves 15 gathers per param byte, deferral 7 reduce-scatters
    # per half a gradient byte, so windowing the unit (22 per 1.5 bytes) comes first.
    plan = choose_levels("budget", units, budget=8000, micro_batches=8)
    assert [u.name for u in plan.windowed] == ["blocks.0"] and len(plan.held) == 1


def test_on_gloo_the_same_budget_defers_two_units():
    units = _units()
    plan = choose_levels(
        "budget", units, budget=8000, micro_batches=8, reduce_scatter_cost=REDUCE_SCATTER_COST["gloo"]
    )  # 19.6 per byte
    assert plan.windowed == () and [u.name for u in plan.held] == ["blocks.0", "blocks.1"]
    # Room for every deferral and one window: deferral first, then the window.
    plan = choose_levels("budget", units, budget=16000, micro_batches=8, reduce_scatter_cost=1.4)
    assert len(plan.held) == 3 and [u.name for u in plan.windowed] == ["blocks.0"]


def test_the_weight_is_the_adapters_backend():
    adapter = ModelAdapter.__new__(ModelAdapter)  # only the backend is read
    for backend, weight in (("gloo", 1.4), ("nccl", 1.0), ("hccl", 1.0), ("", 1.0)):
        adapter.backend = backend
        assert reduce_scatter_cost_of(adapter) == weight


def test_a_plan_is_immutable_and_compared_by_value():
    """A change of plan is a new Plan; two plans with the same fields are the same plan."""
    import dataclasses

    units = _units()
    first = choose_levels("budget", units, 10**9, 4)
    again = choose_levels("budget", units, 10**9, 4)
    assert first == again and first is not again
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.reason = "changed"  # type: ignore[misc]
    assert dataclasses.replace(first, reason="changed") != first


@pytest.mark.parametrize("mode", ["budget", "auto"])
def test_budget_and_auto_plan_within_what_reference_models_keep(mode):
    """`reserved` (what a reference model keeps unsharded beyond one unit's, FrozenModel.kept_bytes)
    comes off the budget or the usable memory first; the reason says how much."""
    from accel_gradsync import GradSyncConfig
    from accel_gradsync.planning.policies import POLICIES

    adapter = ModelAdapter.__new__(ModelAdapter)  # the policies read units, kind, hsdp and backend
    adapter.units, adapter.kind, adapter.hsdp, adapter.backend = _units(), "fsdp2", False, "nccl"
    settings = {"budget": {"memory_budget": "16000B"}, "auto": {"memory_margin": 0.0}}[mode]
    config = GradSyncConfig(sync_mode=mode, **settings)
    policy = POLICIES[mode](config.resolved())
    alone = policy.plan(adapter, lambda: 16000, 8)
    shared = policy.plan(adapter, lambda: 16000, 8, reserved=8000)
    assert alone.held_bytes() > 8000 >= shared.held_bytes() > 0
    assert "kept by reference models" in shared.reason and "reference" not in alone.reason


def test_the_reason_says_which_kept_bytes_are_reference_models_and_which_frozen_units():
    """`reserved` mixes what reference models keep with the model's own frozen units kept for the
    run: a 6-param fp32 unit keeps 24 B, the rest of 100 B is the reference models'."""
    from types import SimpleNamespace

    import torch

    from accel_gradsync.planning.policies import kept_elsewhere
    from accel_gradsync.planning.units import Unit

    base = Unit("base", torch.nn.Linear(2, 2), 0, 0, param_numel=6, resident=True)
    adapter = Unit("adapter", torch.nn.Linear(2, 2), 6, 1)
    model = SimpleNamespace(units=[adapter, base])
    assert kept_elsewhere(100, model) == "76 B kept by reference models, 24 B of frozen units kept unsharded"
    assert kept_elsewhere(24, model) == "24 B of frozen units kept unsharded"
    assert kept_elsewhere(100, SimpleNamespace(units=[adapter])) == "100 B kept by reference models"
