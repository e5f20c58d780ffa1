"""`planning.costs`: the closed-form all-gather counts equal a micro-batch by micro-batch walk."""

import dataclasses

import pytest
import torch

from accel_gradsync.planning.costs import micro_batch_all_gathers, unit_all_gathers
from accel_gradsync.planning.units import Level, Unit


def _walked_all_gathers(unit, level, m, keeps_params_when_held):
    """A step's all-gathers walked micro-batch by micro-batch with `micro_batch_all_gathers`, as
    the live counters see them: every micro-batch but the last is held by a held level, a window
    keeps the params through every forward, and a held backward keeps them where a window (or
    FSDP1 SHARD_GRAD_OP's no_sync) does."""
    held = level in (Level.DEFERRED, Level.WINDOWED, Level.DEFER_ALL_REDUCE)
    windowed = level == Level.WINDOWED
    count, gathered = 0, False
    for k in range(m):
        held_now = held and k < m - 1
        n, gathered = micro_batch_all_gathers(
            unit, gathered, windowed, held_now and (windowed or keeps_params_when_held)
        )
        count += n
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
