"""What TinyNet's runs must issue, derived in the tests from the model's sizes and the configured
mode, never from the package's plan or cost functions: the units a plan holds within a memory
budget, and the reduce-scatters between two optimizer steps of a schedule (workers/schedules.py).

TinyNet (workers/common.py) is three FSDP units, one reduce-scatter each per sync: two Blocks
(a 16x16 Linear, 1088 B of fp32 gradient) and the root's 16->1 head (68 B).
"""

from __future__ import annotations

from itertools import combinations

from workers.common import DIM, TinyNet
from workers.schedules import positions

BLOCK, HEAD = (DIM * DIM + DIM) * 4, (DIM + 1) * 4
"""fp32 gradient bytes of one Block unit and of the root's head."""


def held_within(budget: int) -> tuple[int, ...]:
    """The gradient bytes of the units a plan within `budget` bytes defers. Deferring a unit
    saves M-1 reduce-scatters of its gradient and holds that gradient, so the plan holds the set
    of units with the most gradient bytes that fits. On 2 gloo ranks with M <= 4 a Block's
    deferral saves more per byte than its window (test_policies_levels.py), and a budget that
    fits a Block's window besides has room for every deferral first."""
    sizes = [BLOCK, BLOCK, HEAD]
    fits = [c for n in range(len(sizes) + 1) for c in combinations(sizes, n) if sum(c) <= budget]
    return max(fits, key=lambda c: (sum(c), -len(c)))


def syncing_units(spec: dict) -> int:
    """Units that reduce-scatter once per sync: TinyNet's, less a frozen Block ("frozen" model)."""
    assert spec.get("model", "tiny") in ("tiny", "frozen"), "CondNet's routes skip units; not counted"
    return TinyNet.UNITS - (spec.get("model") == "frozen")


def units_held(spec: dict) -> tuple[int, int]:
    """(units holding their sync before the first optimizer step, after it) under `spec`'s
    config: per_micro_batch none; deferred every unit that reduces; a budget those that fit
    (`held_within`); auto none while step 1 measures, then, with its ample free memory, all."""
    config, units = spec.get("config", {}), syncing_units(spec)
    mode = config.get("sync_mode", "deferred" if config.get("defer") else "per_micro_batch")
    if mode == "per_micro_batch":
        return 0, 0
    if mode == "deferred":
        return units, units
    if mode == "budget":
        assert spec.get("model", "tiny") == "tiny" and config["memory_budget"].endswith("B"), config
        held = len(held_within(int(config["memory_budget"][:-1])))
        return held, held
    assert mode == "auto" and config.get("free_memory") == "64GiB", config  # room for everything
    return 0, units


def expected_reduce_scatters(spec: dict) -> list[int]:
    """Reduce-scatters counted between two optimizer steps: each micro-batch syncs every unit
    but the held ones, the last of a step every unit; a micro-batch that raises in forward, or
    that the loop skips before its backward, issues none (a skipped last one steps nothing: its
    window's reduce-scatters count into the next step); one that raises after backward issues
    what its place implies, counted into the next step, and its window is no step."""
    units, (before, after) = syncing_units(spec), units_held(spec)
    out, pending = [], 0
    for pos in positions(spec):
        if pos["raise"] in ("forward", "skip"):  # no backward: nothing reduced; a skipped last one carries on
            continue
        held = after if out else before
        pending += units if pos["final"] else units - held
        if pos["final"] and pos["raise"] is None:
            out.append(pending)
            pending = 0
    return out


def defers_something(spec: dict) -> bool:
    """Some micro-batch of the schedule holds a unit's reduce-scatter."""
    before, after = units_held(spec)
    steps = 0
    for pos in positions(spec):
        if pos["raise"] not in ("forward", "skip") and not pos["final"] and (after if steps else before):
            return True
        steps += pos["final"] and pos["raise"] is None
    return False
