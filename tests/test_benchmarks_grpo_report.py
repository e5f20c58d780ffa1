"""The GRPO benchmark's target checks on hand-built rows: what the summary concludes from numbers
(the smoke test runs the real benchmark; its timings are never asserted)."""

import copy

from benchmarks import grpo_report

PHASES = ("generation", "logprob", "scoring", "training")


def row(config, times, rounds, gen_gathers=6, train_gathers=0, units=6, loss=0.5):
    counts = {p: {"all_gathers": [0], "reduce_scatters": [0], "all_reduces": [0]} for p in PHASES}
    counts["generation"]["all_gathers"], counts["training"]["all_gathers"] = [gen_gathers], [train_gathers]
    return {"config": config, "units": units, "step_times_s": times, "step_rounds": rounds,
            "counts_seen": counts, "logs": [[{"step": 1, "loss": loss, "reward": 0.5}]],
            "rewards": [[[0.5, 0.25]]], "completions": [[["abc"], ["def"]]]}  # fmt: skip


def results(rows, link=None, quick=False):
    return {"plan": {"quick": quick}, "runs": [{"link": link, "rows": rows}]}


def status(targets, start):
    return {w: (s, m) for w, s, m in targets if w.startswith(start)}


def test_speedup_pairs_rounds_and_the_target_depends_on_the_network():
    stock = row("full/stock", [10.0, 10.0, 4.0, 4.0], [0, 0, 1, 1], gen_gathers=81, train_gathers=44)
    window = row("full/window", [2.0, 2.0, 2.0, 2.0], [0, 0, 1, 1])
    # Per round 5x and 2x: the median over rounds is 3.5x, whatever the pooled medians say.
    assert grpo_report.speedup(results([stock, window])["runs"][0], "full/window", "full/stock") == (3.5, [5.0, 2.0])
    loopback = status(grpo_report.check_targets(results([stock, window])), "[loopback] full/window at least 3x")
    assert [s for s, _ in loopback.values()] == ["PASS"]
    link = status(grpo_report.check_targets(results([stock, window], "1gbit")), "[1gbit link, 2 hosts] full/window at")
    assert [s for s, _ in link.values()] == ["FAIL"]


def test_quick_runs_do_not_decide_timing_targets():
    stock = row("full/stock", [1.0], [0], gen_gathers=25, train_gathers=14)
    window = row("full/window", [0.9], [0])
    targets = status(grpo_report.check_targets(results([stock, window], quick=True)), "[loopback] full/window at")
    ((s, measured),) = targets.values()
    assert s == "SKIP" and measured.startswith("not decided at this size")


def test_window_gathers_count_generation_and_training_together():
    ok = row("full/window", [1.0], [0], gen_gathers=6, train_gathers=0)
    frozen = row("lora/window", [1.0], [0], gen_gathers=22, train_gathers=11, units=7)
    assert grpo_report.check_window_gathers("loopback", ok)[1] == "PASS"
    assert grpo_report.check_window_gathers("loopback", frozen)[1] == "FAIL"


def test_one_differing_loss_fails_the_identity_target():
    stock = row("full/stock", [1.0], [0])
    same, other = row("full/deferred", [1.0], [0]), row("full/window", [1.0], [0], loss=0.5000001)
    rows = {r["config"]: r for r in (stock, same, other)}
    ((what, s, measured),) = [t for t in grpo_report.check_identical("loopback", rows) if "full:" in t[0]]
    assert s == "FAIL" and "full/window round 0: logs differ (step 1: loss 0.5000001 vs stock 0.5)" in measured
    rows["full/window"] = copy.deepcopy(same) | {"config": "full/window"}
    assert [t[1] for t in grpo_report.check_identical("loopback", rows) if "full:" in t[0]] == ["PASS"]
