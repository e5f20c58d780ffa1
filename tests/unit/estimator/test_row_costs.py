"""`estimator.row_costs`: bytes sent follow the ring formulas, and the sharded gradients are what
per_micro_batch keeps between micro-batches."""

import pytest

from accel_gradsync.estimator.core import estimate

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")


def test_bytes_sent_follow_the_ring_formulas(fsdp):
    n, m = 4, 3
    est = estimate("recipe-default", fsdp(2, processes=n), m)
    p = est.params * 4  # fp32
    assert est.mode("per_micro_batch").send_bytes == pytest.approx(m * p * (n - 1) / n, abs=len(est.units))
    assert est.mode("deferred").send_bytes == pytest.approx(p * (n - 1) / n, abs=len(est.units))
    hsdp = estimate("recipe-default", fsdp(2, processes=4, replicate=2), m)  # 2 replicas x 2 shards
    shard_rs = p * (2 - 1) / 2
    shard_ar = 2 * (2 - 1) / 2 * p / 2
    assert hsdp.mode("per_micro_batch").send_bytes == pytest.approx(m * (shard_rs + shard_ar), abs=8)
    assert hsdp.mode("defer_all_reduce").send_bytes == pytest.approx(m * shard_rs + shard_ar, abs=8)


def test_sharded_gradients_are_what_per_micro_batch_keeps_between_micro_batches(fsdp):
    n = 4
    est = estimate("recipe-default", fsdp(2, processes=n), 4)
    sharded = est.mode("per_micro_batch").sharded_bytes
    # About P/N x 4 bytes: each rank's padded shard of every unit, in the fp32 sharded dtype.
    assert est.params * 4 / n <= sharded <= est.params * 4 / n + len(est.units) * 4 * 1024
    assert est.mode("deferred").sharded_bytes == 0  # nothing is reduced before the last micro-batch
    assert est.mode("per_micro_batch").held_bytes == 0
