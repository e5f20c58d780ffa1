"""`estimator.fake_shard`: the fake process group exists only while the model is sharded, a real one
can follow it, and a process that already has one is refused and keeps it."""

import pytest
import torch
import torch.distributed as dist

from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.fake_shard import fake_world

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")


def test_no_process_group_is_left_behind_and_a_real_one_can_follow(fsdp):
    estimate("recipe-default", fsdp(2, processes=4, replicate=2), 2)
    estimate("recipe-default", fsdp(1, processes=8), 2)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        total = torch.ones(3)
        dist.all_reduce(total)
        assert (dist.get_backend(), dist.get_world_size(), total.tolist()) == ("gloo", 1, [1.0, 1.0, 1.0])
    finally:
        dist.destroy_process_group()


def test_a_process_that_has_a_process_group_is_refused_and_keeps_it(fsdp):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already has a torch.distributed process group.*its own process"):
            estimate("recipe-default", fsdp(2), 2)
        assert (dist.get_backend(), dist.get_world_size()) == ("gloo", 1)
    finally:
        dist.destroy_process_group()


def test_the_fake_process_group_is_removed_when_sharding_fails():
    with pytest.raises(RuntimeError, match="while sharded"), fake_world(8):
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("fake", 8, 0)
        raise RuntimeError("while sharded")
    assert not dist.is_initialized()
