"""decision.py's lines, without processes: FSDP2 models sharded by torch's own `fully_shard` on
the meta device in a fake process group (as `accel-gradsync estimate` does)."""

import dataclasses

import pytest
from torch import nn
from torch.distributed.fsdp import fully_shard

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.fake_shard import fake_world
from accel_gradsync.planning.policies import DeferredSync
from accel_gradsync.runtime.core.decision import WHY, describe_decision, describe_frozen
from accel_gradsync.runtime.wrappers.adapt import adapt_model

M = 4


def sharded(reshard_after_forward: bool | None, trainable: bool = False):
    """A one-unit model (the root) sharded over 2 fake ranks, as accelerate shards a root (FSDP2
    chooses: a root keeps its params after forward) or as TRL's prepare_fsdp does (True)."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.requires_grad_(trainable)
    with fake_world(2):
        fully_shard(model, **({} if reshard_after_forward is None else {"reshard_after_forward": True}))
        adapter = adapt_model(model)
    assert adapter is not None and len(adapter.units) == 1
    return adapter


@pytest.mark.parametrize("keeps", [True, False])
def test_a_root_that_stays_unsharded_gathers_once_and_the_line_says_so(keeps):
    """FSDP2 leaves a root unsharded after its forward: the first forward without gradients
    gathers it (1 all-gather), no later forward does, so keeping it saves nothing."""
    line = describe_frozen("ref", "Sequential", sharded(None), keeps)
    assert "-> 1 all-gather at its first forward without gradients and none per forward after it" in line, line
    assert "instead of" not in line and "per pass" not in line, line


def test_a_root_that_reshards_is_kept_through_a_pass():
    """TRL's reference model reshards after each forward: 1 all-gather per forward, once per pass
    where the plugin keeps it."""
    line = describe_frozen("ref", "Sequential", sharded(True), keeps=True)
    assert (
        "-> 1 all-gather per pass of forwards without gradients (a step's log-prob pass) instead of 1 per forward"
        in line
    )


def test_the_policy_s_reason_is_a_second_line():
    adapter = sharded(True, trainable=True)
    plan = DeferredSync(GradSyncConfig(defer=True).resolved()).plan(adapter, lambda: 2**30, M)
    reason = "auto planned step 1 from the forecast: peak 6.7 MiB/rank syncing every micro-batch"
    first, *rest = describe_decision(dataclasses.replace(plan, reason=reason), adapter, M).splitlines()
    assert first == describe_decision(plan, adapter, M)  # the decision and its cost, nothing more
    assert rest == [WHY + reason]


def test_per_rank_counts_are_said_only_in_a_loop_of_step_n_and_say_what_makes_them_free():
    adapter = sharded(True, trainable=True)
    plan = DeferredSync(GradSyncConfig(defer=True).resolved()).plan(adapter, lambda: 2**30, M)
    assert "per-rank" not in describe_decision(plan, adapter, M)  # no step(n): not said
    free = describe_decision(plan, adapter, M, counts_free=True)
    assert "; per-rank micro-batch counts (step(n)) free: a step issues the same collectives" in free, free
    replays = describe_decision(plan, adapter, M, counts_free=False)
    assert "replays its last micro-batch x 0 up to it, as padding would" in replays, replays
    assert "(deferred with keep_params_unsharded, every unit windowed, makes them free)" in replays, replays
