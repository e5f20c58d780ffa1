"""uneven.py in one process: the one line that names each rank's count of micro-batches. The check
on 2 ranks (refused at `wait_for_everyone()` on every rank) is in
tests/distributed/test_uneven_inputs.py."""

from __future__ import annotations

from accel_gradsync.runtime.uneven_inputs.uneven import by_rank


def test_the_refusals_name_each_ranks_count_in_one_line():
    line = by_rank([(8, False), (1, True), (0, True)])
    assert line == (
        "rank 0: 8 micro-batches, rank 1: 1 micro-batch (left the loop), rank 2: 0 micro-batches (left the loop)"
    )
