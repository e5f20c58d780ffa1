"""The benchmark's target checks on hand-built rows: the paired statistics behind PASS/FAIL.
(The smoke test runs the real harness; these pin down what the summary concludes from numbers.)"""

from benchmarks import registry, report
from benchmarks.worker import round_order


def row(config, M, times, held=0, rounds=None):
    return {"config": config, "M": M, "step_times_s": times, "step_cpus_s": times,
            "step_rounds": list(range(len(times))) if rounds is None else rounds,
            "step_time_s": sorted(times)[len(times) // 2], "held_grad_bytes": held,
            "counts_seen_per_step": {"reduce_scatters": [], "all_reduces": []}}  # fmt: skip


def run_of(rows, ranks=2):
    return {"size": "small", "ranks": ranks, "rows": rows, "unavailable": {}, "facts": {"units": 5}}


def test_paired_ratios_pair_steps_by_round_not_by_position():
    a = row("deferred", 4, [1.0, 2.0, 1.1], rounds=[0, 1, 2])
    b = row("raw_fsdp2", 4, [2.0, 1.0], rounds=[1, 0])  # a round-1 burst hit both
    assert report.paired_ratios(run_of([a, b]), "deferred", "raw_fsdp2", [4]) == {4: [1.0, 1.0]}


def test_median_ci_brackets_the_median_and_is_reproducible():
    values = [0.9, 1.0, 1.01, 1.02, 1.1, 1.3]
    stat = report.median_ci(values)
    assert stat[1] <= stat[0] <= stat[2]
    assert stat == report.median_ci(values)


def test_overhead_fails_when_the_paired_median_is_over_2_percent():
    times = [1.0, 1.5, 0.8, 1.2, 1.1]  # the machine's load moves both configurations alike
    fast = [run_of([row("deferred", 2, [t * 1.01 for t in times]), row("raw_fsdp2", 2, times)])]
    slow = [run_of([row("deferred", 2, [t * 1.05 for t in times]), row("raw_fsdp2", 2, times)])]
    for runs, want in ((fast, "PASS"), (slow, "FAIL")):
        results = {"runs": runs, "plan": {"Ms": [2], **{k: None for k in ("sizes", "configs", "reps", "steps")}},
                   "elapsed_s": 1}  # fmt: skip
        status = {w: s for w, s, _ in report.check_targets(results)}
        assert status["deferred (plugin) within 2% of the hand-written raw-API loop"] == want


def test_frontier_compares_each_round_with_that_rounds_segment():
    def results(budget_times, held):
        rows = [row("per_micro_batch", 8, [2.0, 4.0], held=100), row("deferred", 8, [1.0, 2.0], held=200),
                row("window", 8, [0.5, 1.0], held=300), row("budget_50", 8, budget_times, held=held)]  # fmt: skip
        return {"plan": {"Ms": [8]}}, [run_of(rows)]

    # Per-micro-batch -> deferred at 150: 1.5 s in round 0 and 3.0 s in round 1.
    assert report.check_frontier(*results([1.5, 2.9], 150))[1] == "PASS"
    assert report.check_frontier(*results([1.7, 3.4], 150))[1] == "FAIL"  # +13% of a step in both rounds
    # Deferred -> window at 250: 0.75 s and 1.5 s.
    assert report.check_frontier(*results([0.75, 1.45], 250))[1] == "PASS"
    assert report.check_frontier(*results([1.0, 2.0], 250))[1] == "FAIL"  # as slow as deferral, holding more


def test_round_order_keeps_pairs_adjacent_and_alternates_who_runs_first():
    runs = [{"name": n} for n in registry.CONFIGS if registry.ranks(n) == 2]
    first = {}
    for k in range(6):
        names = [r["name"] for r in round_order(runs, k)]
        assert sorted(names) == sorted(r["name"] for r in runs)
        for a, b in registry.PAIRS:
            i, j = names.index(a), names.index(b)
            assert abs(i - j) == 1
            first.setdefault((a, b), i < j)
            assert (i < j) == (first[(a, b)] == (k % 2 == 0))  # flips every round
