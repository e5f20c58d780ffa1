"""`catch_up` (runtime/generating/draw_replay.py) on 2 real gloo ranks (workers/draw_replay.py): after a
generation without transformers' sync, rank 0 ran 3 forwards and rank 1 ran 7. Whether rank 0 gets
the answer (7) before it replays ahead, after 5 replays ahead (back to a generator state it kept) or
after 20 (further than it keeps: from the start again), each rank's random state ends where exactly
the forwards it is short leave it: rank 0's after 4 replays, rank 1's untouched."""

import pytest
from launcher import launch

AHEAD = [0, 5, 20]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replays")
    return launch("draw_replay", ["--ahead", *map(str, AHEAD), "--tmp", str(tmp)], timeout=180)


@pytest.mark.parametrize("ahead", AHEAD)
def test_each_rank_ends_with_the_draws_of_the_forwards_it_is_short(ranks, ahead):
    for rank in ranks:
        run = rank[str(ahead)]
        assert run["got"] == run["expected"], (ahead, run)


def test_a_rank_further_ahead_than_it_keeps_replays_from_the_start_again(ranks):
    assert ranks[0]["20"]["replays"] >= 20 + 4, ranks[0]["20"]
