"""The GRPO benchmark's target checks on hand-built rows: what the summary concludes from numbers
(the smoke test runs the real benchmark; its timings are never asserted)."""

import dataclasses
import json

from benchmarks import grpo_report
from benchmarks.records import GrpoResults, GrpoRow, GrpoRun

PHASES = ("generation", "logprob", "scoring", "training")


def row(config, times, rounds, gen_gathers=6, train_gathers=0, units=6, loss=0.5):
    counts = {p: {"all_gathers": [0], "reduce_scatters": [0], "all_reduces": [0]} for p in PHASES}
    counts["generation"]["all_gathers"], counts["training"]["all_gathers"] = [gen_gathers], [train_gathers]
    return GrpoRow(
        config=config,
        units=units,
        step_times_s=times,
        step_rounds=rounds,
        counts_seen=counts,
        logs=[[{"step": 1, "loss": loss, "reward": 0.5}]],
        rewards=[[[0.5, 0.25]]],
        completions=[[["abc"], ["def"]]],
    )


def results(rows, link=None, quick=False):
    run = GrpoRun(size="quick", facts={}, rows=rows, link=link)
    return GrpoResults(command="", plan={"quick": quick}, machine={}, elapsed_s=1, runs=[run])


def status(checked, start):
    return {r.target: (r.status, r.measured) for r in checked if r.target.startswith(start)}


def test_speedup_pairs_rounds_and_the_target_depends_on_the_network():
    stock = row("full/stock", [10.0, 10.0, 4.0, 4.0], [0, 0, 1, 1], gen_gathers=81, train_gathers=44)
    window = row("full/window", [2.0, 2.0, 2.0, 2.0], [0, 0, 1, 1])
    # Per round 5x and 2x: the median over rounds is 3.5x, whatever the pooled medians say.
    assert grpo_report.speedup(results([stock, window]).runs[0], "full/window", "full/stock") == (3.5, [5.0, 2.0])
    loopback = status(grpo_report.check_targets(results([stock, window])), "[loopback] full/window at least 3x")
    assert [s for s, _ in loopback.values()] == ["PASS"]
    link = status(grpo_report.check_targets(results([stock, window], "1gbit")), "[1gbit link, 2 hosts] full/window at")
    assert [s for s, _ in link.values()] == ["FAIL"]


def test_a_quick_run_decides_the_speedup_only_when_the_interval_is_on_one_side():
    def speedup_status(window_times):
        rounds = list(range(len(window_times)))
        stock, window = row("full/stock", [1.0] * len(rounds), rounds), row("full/window", window_times, rounds)
        checked = grpo_report.check_targets(results([stock, window], quick=True))
        ((s, measured),) = status(checked, "[loopback] full/window at").values()
        return s, measured

    assert speedup_status([0.2] * 5)[0] == "PASS"  # 5x in every round
    assert speedup_status([0.9] * 5)[0] == "FAIL"  # 1.1x in every round
    s, measured = speedup_status([0.2, 0.5, 0.25, 0.45, 0.3])  # 2.2x to 5x: straddles 3x
    assert s == "N/D" and measured.startswith("not decided at this size")
    assert speedup_status([0.9])[0] == "N/D"  # one round: no interval at all


def test_the_window_is_judged_against_ddp_on_time_and_on_memory_between_steps():
    def floor(window_times, window_state, ddp_state=1000):
        rounds = list(range(len(window_times)))
        ddp = dataclasses.replace(row("full/ddp", [1.0] * len(rounds), rounds), state_bytes=ddp_state)
        window = dataclasses.replace(row("full/window", window_times, rounds), state_bytes=window_state)
        checked = grpo_report.check_targets(results([ddp, window]))
        ((time_status, measured),) = status(checked, "[loopback] full/window within 1.10x").values()
        ((state_status, _),) = status(checked, "[loopback] full/window: memory between").values()
        return time_status, measured, state_status

    # 1.05x and 1.2x DDP's step per round: the median over rounds, 1.125x, misses the floor target.
    assert floor([1.05, 1.2], 500)[:2] == ("FAIL", "1.12x (per round: 1.05x, 1.20x)")
    assert floor([1.05, 1.08], 500) == ("PASS", "1.06x (per round: 1.05x, 1.08x)", "PASS")
    assert floor([1.0], 1000)[2] == "FAIL"  # as much as DDP between steps: not sharded
    skipped = status(grpo_report.check_targets(results([row("full/window", [1.0], [0])])), "[loopback] full/window")
    assert {s for k, (s, _) in skipped.items() if "ddp" in k} == {"SKIP"}  # no DDP run


def test_window_gathers_count_generation_and_training_together():
    ok = row("full/window", [1.0], [0], gen_gathers=6, train_gathers=0)
    frozen = row("lora/window", [1.0], [0], gen_gathers=22, train_gathers=11, units=7)
    assert grpo_report.check_window_gathers("loopback", ok).status == "PASS"
    assert grpo_report.check_window_gathers("loopback", frozen).status == "FAIL"


def test_one_differing_loss_fails_the_identity_target():
    stock = row("full/stock", [1.0], [0])
    same, other = row("full/deferred", [1.0], [0]), row("full/window", [1.0], [0], loss=0.5000001)
    rows = {r.config: r for r in (stock, same, other)}
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "FAIL" and "full/window round 0: logs differ (step 1: loss 0.5000001 vs stock 0.5)" in measured
    rows["full/window"] = dataclasses.replace(same, config="full/window")
    assert [t.status for t in full_only(grpo_report.check_identical("loopback", rows))] == ["PASS"]


def test_modes_that_sum_in_another_order_match_stock_within_rounding_and_no_further():
    """per_micro_batch, auto (its measured step 1) and DDP add the same gradients in another
    floating-point order: their logged values may differ from stock's in the last digits (within
    1e-4 relative), never more; deferral's configurations must match exactly."""
    stock = row("full/stock", [1.0], [0], loss=8.025467650440987e-06)
    rounded = [row(f"full/{m}", [1.0], [0], loss=8.025485840335023e-06) for m in ("ddp", "per_micro_batch", "auto")]
    rows = {r.config: r for r in (stock, *rounded)}
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "PASS" and "at most 2.3e-06 relative off" in measured, measured
    rows["full/deferred"] = row("full/deferred", [1.0], [0], loss=8.025485840335023e-06)  # sums as stock: exact
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "FAIL" and measured.startswith("full/deferred round 0: logs differ"), measured
    del rows["full/deferred"]
    rows["full/ddp"] = row("full/ddp", [1.0], [0], loss=8.03e-06)  # 5e-4 off: more than rounding
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "FAIL" and "full/ddp round 0: logs differ" in measured


def test_results_survive_the_json_round_trip():
    stock = row("full/stock", [1.0, 1.2], [0, 1])
    stock.phase_time_s, stock.handle_held_grad_bytes = {"generation": 0.5, "training": 0.5}, None
    before = results([stock], link="1gbit")
    assert GrpoResults.from_dict(json.loads(json.dumps(dataclasses.asdict(before)))) == before


def full_only(checked):
    return [t for t in checked if "full:" in t.target]


def test_the_floor_says_what_the_collectives_alone_cost_on_the_network():
    """The backend's own price of the window's pair (all-gather + reduce-scatter of the model) against
    DDP's all-reduce of the same bytes: in the floor target's line and under the table."""
    ddp, window = row("full/ddp", [1.0], [0]), row("full/window", [1.5], [0])
    run = GrpoRun(
        size="quick",
        facts={"params": 2**20},
        rows=[ddp, window],
        backend_ms={"all_gather": 30.0, "reduce_scatter": 50.0, "all_reduce": 40.0},
    )
    out = GrpoResults(command="", plan={}, machine={}, elapsed_s=1, runs=[run])
    ((_, measured),) = status(grpo_report.check_targets(out), "[loopback] full/window within 1.10x").values()
    assert measured.endswith("collectives alone: all-gather + reduce-scatter = 2.00x all-reduce of the same bytes")
    line = grpo_report.backend_line(run)
    assert "all-gather 30 ms, reduce-scatter 50 ms, all-reduce 40 ms" in line and "costs 2.00x it" in line
    assert "4.0 MiB" in line
    # A results.json from before the measurement: no line, no note.
    plain = grpo_report.check_floor(GrpoRun(size="quick", facts={}, rows=[ddp, window]), "loopback", "full", False)
    assert "collectives alone" not in plain[0].measured
