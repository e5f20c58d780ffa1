"""The MLP benchmark's target checks on hand-built rows: the paired statistics behind
PASS/FAIL/N/D (the smoke test runs the real harness; these pin down what the summary concludes
from numbers), the records' JSON round trip and the interleaving order."""

import dataclasses
import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import mlp, mlp_report  # noqa: E402
from benchmarks.records import ConfigResult, Results, Run  # noqa: E402

OVERHEAD = "deferred (plugin) within 2% of the hand-written raw-API loop"


def row(config, M, times, held=0, rounds=None):
    return ConfigResult(
        config=config,
        M=M,
        step_times_s=times,
        step_cpus_s=times,
        step_rounds=list(range(len(times))) if rounds is None else rounds,
        step_time_s=sorted(times)[len(times) // 2],
        held_grad_bytes=held,
        counts_seen_per_step={"reduce_scatters": [], "all_reduces": [], "all_gathers": []},
    )


def run_of(rows, ranks=2):
    return Run(size="small", facts={"units": 5}, device="cpu", ranks=ranks, rows=rows)


def results_of(runs, Ms, quick=False):
    plan = {"Ms": Ms, "quick": quick, **dict.fromkeys(("sizes", "configs", "reps", "steps"))}
    return Results(command="", plan=plan, machine={}, elapsed_s=1, runs=runs)


def overhead_status(ratio, times, quick):
    rows = [row("deferred", 2, [t * ratio for t in times]), row("raw_fsdp2", 2, times)]
    checked = {r.target: r for r in mlp_report.check_targets(results_of([run_of(rows)], [2], quick))}
    return checked[OVERHEAD]


def test_paired_ratios_pair_steps_by_round_not_by_position():
    a = row("deferred", 4, [1.0, 2.0, 1.1], rounds=[0, 1, 2])
    b = row("raw_fsdp2", 4, [2.0, 1.0], rounds=[1, 0])  # a round-1 burst hit both
    assert mlp_report.paired_ratios(run_of([a, b]), "deferred", "raw_fsdp2", [4]) == {4: [1.0, 1.0]}


def test_overhead_fails_when_the_paired_median_is_over_2_percent():
    times = [1.0, 1.5, 0.8, 1.2, 1.1]  # the machine's load moves both configurations alike
    assert overhead_status(1.01, times, quick=False).status == "PASS"
    assert overhead_status(1.05, times, quick=False).status == "FAIL"


def test_a_quick_run_decides_a_timing_target_only_when_the_interval_is_on_one_side():
    times = [1.0, 1.5, 0.8, 1.2, 1.1]
    # Every round 1% or 5% slower: the intervals are one point, wholly inside or outside.
    assert overhead_status(1.01, times, quick=True).status == "PASS"
    assert overhead_status(1.05, times, quick=True).status == "FAIL"
    # Rounds from 0.8x to 1.25x: the interval straddles 1.02, so a quick run cannot tell.
    a = [t * r for t, r in zip(times, [0.8, 1.25, 0.9, 1.2, 1.0], strict=True)]
    rows = [row("deferred", 2, a), row("raw_fsdp2", 2, times)]
    undecided = {r.target: r for r in mlp_report.check_targets(results_of([run_of(rows)], [2], quick=True))}[OVERHEAD]
    assert undecided.status == "N/D" and undecided.measured.startswith("not decided at this size: ")
    # The same rounds in a full run: decided on the median (1.0 <= 1.02).
    decided = {r.target: r for r in mlp_report.check_targets(results_of([run_of(rows)], [2], quick=False))}[OVERHEAD]
    assert decided.status == "PASS"


def test_frontier_compares_each_round_with_that_rounds_segment():
    def results(budget_times, held):
        rows = [
            row("per_micro_batch", 8, [2.0, 4.0], held=100),
            row("deferred", 8, [1.0, 2.0], held=200),
            row("windowed", 8, [0.5, 1.0], held=300),
            row("budget_50", 8, budget_times, held=held),
        ]
        return results_of([], [8]), [run_of(rows)]

    # Per-micro-batch -> deferred at 150: 1.5 s in round 0 and 3.0 s in round 1.
    assert mlp_report.check_frontier(*results([1.5, 2.9], 150)).status == "PASS"
    assert mlp_report.check_frontier(*results([1.7, 3.4], 150)).status == "FAIL"  # +13% of a step in both rounds
    # Deferred -> windowed at 250: 0.75 s and 1.5 s.
    assert mlp_report.check_frontier(*results([0.75, 1.45], 250)).status == "PASS"
    assert mlp_report.check_frontier(*results([1.0, 2.0], 250)).status == "FAIL"  # as slow as deferral, holding more


def test_results_survive_the_json_round_trip():
    results = results_of([run_of([row("deferred", 2, [1.0, 1.1]), row("raw_fsdp2", 2, [1.0, 1.0])])], [2])
    assert Results.from_dict(json.loads(json.dumps(dataclasses.asdict(results)))) == results


def test_round_order_keeps_pairs_adjacent_and_alternates_who_runs_first():
    names = [n for n in mlp.CONFIGS if mlp.ranks(n) == 2]
    first = {}
    for k in range(6):
        order = mlp.round_order(names, k)
        assert sorted(order) == sorted(names)
        for a, b in mlp.PAIRS:
            i, j = order.index(a), order.index(b)
            assert abs(i - j) == 1
            first.setdefault((a, b), i < j)
            assert (i < j) == (first[(a, b)] == (k % 2 == 0))  # flips every round
