"""Frozen FSDP units and `gather_for_generation` in the planning code, without processes: a Qwen2
config sharded by accelerate's and torch's own code on the meta device in a fake process group
(as `accel-gradsync estimate` does), its root's parameters (embeddings, norm, tied head) frozen.

A frozen unit reduces nothing and holds no gradient but all-gathers in every forward: the
decision line, the estimate and the budget count it. (Against real gloo ranks, with counts
taken from outside: tests/distributed/test_generation.py.)"""

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.planning.costs import (
    all_gathers_per_step,
    collectives_per_step,
    generation_all_gathers_per,
    generation_cost,
    unit_all_gathers,
)
from accel_gradsync.planning.policies import BudgetSync, DeferredSync, PerMicroBatchSync, choose_levels
from accel_gradsync.runtime.core.decision import describe_decision

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")

ACCELERATE = {
    "distributed_type": "FSDP",
    "num_processes": 2,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
    },
}
M = 4


def adapter_with_frozen_root(config=None):
    model = build_meta_model(load_model_config("recipe-default"))
    model.model.embed_tokens.requires_grad_(False)  # the head is tied to it
    model.model.norm.requires_grad_(False)
    return estimated_adapter(model, read_accelerate_config(ACCELERATE), config or GradSyncConfig())


@pytest.fixture(scope="module")
def adapter():
    return adapter_with_frozen_root()


def test_a_frozen_root_is_a_unit_that_gathers_and_reduces_nothing(adapter):
    # accelerate shards embeddings, tied head and final norm as one unit (`fully_shard([...])`).
    frozen = [u for u in adapter.units if u.frozen]
    assert [u.name for u in frozen] == ["model.embed_tokens"] and len(adapter.units) == 3
    root = frozen[0]
    assert root.collectives == 0 and root.held_bytes == 0 and root.reduce_bytes == 0
    assert root.param_numel > 0 and root.param_bytes == root.param_numel * 4
    # Trainable units count their frozen parameters in what they gather too.
    assert all(u.param_numel >= u.numel > 0 for u in adapter.units if not u.frozen)


def test_decision_line_counts_the_frozen_units_all_gathers(adapter):
    plan = DeferredSync(GradSyncConfig(defer=True).resolved()).plan(adapter, lambda: 0, M)
    rs, _ = collectives_per_step(plan, adapter.units, adapter.hsdp, M)
    gathers, _ = all_gathers_per_step(plan, adapter, M)
    assert rs == 2  # the two decoder layers; the frozen root reduces nothing
    # Each layer twice per micro-batch (forward, and backward after its reshard), the frozen unit
    # (kept through backward, like a root) once.
    assert gathers == 2 * 2 * M + M == sum(unit_all_gathers(u, "deferred", M) for u in adapter.units)
    line = describe_decision(plan, adapter, M)
    assert f"2 reduce-scatters and {gathers} all-gathers/step" in line, line
    assert "2 deferred, 1 frozen" in line, line


def test_the_window_keeps_frozen_units_too_within_the_budget(adapter):
    window = DeferredSync(GradSyncConfig(defer=True, keep_params_unsharded=True).resolved()).plan(adapter, lambda: 0, M)
    assert len(window.windowed) == 3 and all_gathers_per_step(window, adapter, M)[0] == 3
    assert window.held_param_bytes() == sum(u.param_bytes for u in adapter.units)
    root = next(u for u in adapter.units if u.frozen)
    # Exactly what the frozen unit's window costs: its parameter bytes; taken (it saves M - 1 gathers).
    only_root = choose_levels("budget", adapter.units, root.param_bytes, M)
    assert only_root.windowed == (root,) and only_root.level(root) == "windowed"
    less = choose_levels("budget", adapter.units, root.param_bytes - 1, M)
    assert less.level(root) == "frozen" and not less.windowed


def test_gather_for_generation_bytes_enter_budget_and_the_decision_line():
    config = GradSyncConfig(sync_mode="budget", memory_budget="1GiB", gather_for_generation=True)
    adapter = adapter_with_frozen_root(config)
    generation = sum(u.param_bytes for u in adapter.units)
    plan = BudgetSync(config.resolved()).plan(adapter, lambda: 0, M)
    assert plan.generation_bytes == generation
    # Generation holds every unit's params already: every unit is windowed at no extra cost.
    assert len(plan.windowed) == 3
    line = describe_decision(plan, adapter, M)
    assert f"generation {len(adapter.units)} all-gathers per round" in line, line
    # A budget that generation alone fills leaves nothing to defer; windows cost nothing more.
    tight = GradSyncConfig(sync_mode="budget", memory_budget=f"{generation}B", gather_for_generation=True)
    tight_plan = BudgetSync(tight.resolved()).plan(adapter, lambda: 0, M)
    assert [u for u in tight_plan.held if not u.frozen] == [] and tight_plan.held_grad_bytes() == 0
    off = PerMicroBatchSync(GradSyncConfig().resolved()).plan(adapter, lambda: 0, M)
    assert off.generation_bytes == 0
    per_token = generation_all_gathers_per(adapter.units, kept=False)
    assert per_token == 2 and f"generation {per_token} all-gathers per token" in describe_decision(off, adapter, M)


def test_the_estimate_and_the_decision_line_read_one_generation_cost(fsdp_rows):
    """The estimate's generation columns, the decision line and `costs.generation_cost` give the
    all-gathers worked out here from the model: accelerate makes each decoder layer a unit that
    reshards after forward, and the root (embeddings, final norm, tied head) one that FSDP2 keeps
    after forward. A generation round's first forward gathers every unit and each token after it
    every layer again; inside a window (every unit windowed) nothing per token; with
    gather_for_generation every unit once per round."""
    adapter = fsdp_rows.pop("adapter")
    layers = load_model_config("recipe-default").num_hidden_layers
    units = layers + 1
    assert len(adapter.units) == units
    # row: (first forward, per token or per round, per token inside a window, kept for the round)
    expected = {
        "per_micro_batch": (units, layers, None, False),
        "deferred+windowed": (units, layers, 0, False),
        "gather": (units, units, None, True),
    }
    assert sorted(fsdp_rows) == sorted(expected)
    for name, row in fsdp_rows.items():
        first, per, in_window, kept = expected[name]
        cost = generation_cost(row["plan"], adapter.units)
        assert (cost.first, cost.per_token_in_window, cost.kept) == (first, in_window, kept), (name, cost)
        assert cost.kept or cost.per_token == per, (name, cost)
        est = row["estimate"]
        assert est.generation_first_all_gathers == first, (name, est)
        assert est.generation_all_gathers == per, (name, est)
        assert est.generation_all_gathers_in_window == in_window, (name, est)
        line = describe_decision(row["plan"], adapter, M)
        if kept:
            assert f"generation {per} all-gathers per round" in line, (name, line)
        else:
            assert f"generation {per} all-gathers per token after its first forward's {first}" in line, (name, line)
        if in_window is not None:
            assert f"inside one (TRL generates in its first micro-batch) {in_window} per" in line, (name, line)


@pytest.fixture
def fsdp_rows():
    """Each row's plan (over the recipe's model, nothing frozen) and the estimate's row of the same mode."""
    from accel_gradsync.estimator.core import estimate

    adapter = estimated_adapter(
        build_meta_model(load_model_config("recipe-default")), read_accelerate_config(ACCELERATE), GradSyncConfig()
    )
    window = GradSyncConfig(sync_mode="deferred", keep_params_unsharded=True)
    rows = {
        "per_micro_batch": (PerMicroBatchSync(GradSyncConfig().resolved()), GradSyncConfig(), "per_micro_batch"),
        "deferred+windowed": (DeferredSync(window.resolved()), window, "deferred+windowed"),
        "gather": (
            PerMicroBatchSync(GradSyncConfig(gather_for_generation=True).resolved()),
            GradSyncConfig(gather_for_generation=True),
            "per_micro_batch",
        ),
    }
    out: dict = {"adapter": adapter}
    for name, (policy, config, mode) in rows.items():
        plan = policy.plan(adapter, lambda: 0, M)
        est = estimate("recipe-default", ACCELERATE, M, config)
        out[name] = {"plan": plan, "estimate": est.mode(mode)}
    return out
