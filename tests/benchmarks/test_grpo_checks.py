"""The GRPO benchmark's target checks on hand-built rows: what the summary concludes from numbers
(the smoke test runs the real benchmark; its timings are never asserted)."""

import dataclasses

from grpo_rows import results, row, status

from benchmarks import grpo_report
from benchmarks.records import GrpoRun


def test_speedup_pairs_rounds_and_the_target_depends_on_the_network():
    stock = row("full/stock", [10.0, 10.0, 4.0, 4.0], [0, 0, 1, 1], gen_gathers=81, train_gathers=44)
    window = row("full/windowed", [2.0, 2.0, 2.0, 2.0], [0, 0, 1, 1])
    # Per round 5x and 2x: the median over rounds is 3.5x, whatever the pooled medians say.
    assert grpo_report.speedup(results([stock, window]).runs[0], "full/windowed", "full/stock") == (3.5, [5.0, 2.0])
    loopback = status(grpo_report.check_targets(results([stock, window])), "[loopback] full/windowed at least 3x")
    assert [s for s, _ in loopback.values()] == ["PASS"]
    link = status(
        grpo_report.check_targets(results([stock, window], "1gbit")), "[1gbit link, 2 hosts] full/windowed at"
    )
    assert [s for s, _ in link.values()] == ["FAIL"]


def test_a_quick_run_decides_the_speedup_only_when_the_interval_is_on_one_side():
    def speedup_status(window_times):
        rounds = list(range(len(window_times)))
        stock, window = row("full/stock", [1.0] * len(rounds), rounds), row("full/windowed", window_times, rounds)
        checked = grpo_report.check_targets(results([stock, window], quick=True))
        ((s, measured),) = status(checked, "[loopback] full/windowed at").values()
        return s, measured

    assert speedup_status([0.2] * 5)[0] == "PASS"  # 5x in every round
    assert speedup_status([0.9] * 5)[0] == "FAIL"  # 1.1x in every round
    s, measured = speedup_status([0.2, 0.5, 0.25, 0.45, 0.3])  # 2.2x to 5x: straddles 3x
    assert s == "N/D" and measured.startswith("not decided at this size")
    assert speedup_status([0.9])[0] == "N/D"  # one round: no interval at all


def test_windowed_is_judged_against_ddp_on_the_median_round_and_on_memory_between_steps():
    def floor(window_times, window_state, ddp_state=1000, ref_bytes=0):
        rounds = list(range(len(window_times)))
        ddp = row("full/ddp", [1.0] * len(rounds), rounds, state_bytes=ddp_state)
        window = row("full/windowed", window_times, rounds, state_bytes=window_state, ref_unsharded_bytes=ref_bytes)
        checked = grpo_report.check_targets(results([ddp, window]))
        ((time_status, measured),) = status(checked, "[loopback] full/windowed within 1.10x").values()
        ((state_status, state),) = status(checked, "[loopback] full/windowed: memory between").values()
        return time_status, measured, state_status, state

    # 1.05x and 1.2x DDP's step per round: the median over rounds, 1.125x, misses the floor target.
    assert floor([1.05, 1.2], 500)[:2] == (
        "FAIL",
        "1.12x, median of 2 round(s) (per round: 1.05x, 1.20x; spread 1.05x-1.20x)",
    )
    # One round far off (the machine's load while it ran) does not decide it: the median round does.
    assert floor([1.9, 1.05, 1.08], 500)[:2] == (
        "PASS",
        "1.08x, median of 3 round(s) (per round: 1.90x, 1.05x, 1.08x; spread 1.05x-1.90x)",
    )
    assert floor([1.0], 1000)[2] == "FAIL"  # as much as DDP between steps
    # A resident reference model: its unsharded bytes stated against DDP's.
    _, _, state_status, state = floor([1.0], 3 * 2**20, ddp_state=4 * 2**20, ref_bytes=2**20)
    assert state_status == "PASS"
    assert state == "3.00 MiB against 4.00 MiB per rank (0.75x); of it, the reference model kept unsharded: 1.00 MiB"
    skipped = status(grpo_report.check_targets(results([row("full/windowed", [1.0], [0])])), "[loopback] full/windowed")
    assert {s for k, (s, _) in skipped.items() if "ddp" in k} == {"SKIP"}  # no DDP run


def test_windowed_gathers_count_generation_and_training_together():
    ok = row("full/windowed", [1.0], [0], gen_gathers=6, train_gathers=0)
    frozen = row("lora/windowed", [1.0], [0], gen_gathers=22, train_gathers=11, units=7)
    assert grpo_report.check_windowed_gathers("loopback", ok).status == "PASS"
    assert grpo_report.check_windowed_gathers("loopback", frozen).status == "FAIL"


def test_windowed_generation_issues_no_all_reduce():
    quiet = row("full/windowed", [1.0], [0])
    synced = row("full/windowed", [1.0], [0])
    synced.counts_seen["generation"]["all_reduces"] = [0, 33]  # one step ran transformers' per-token sync
    assert grpo_report.check_generation_all_reduces("loopback", quiet, None, "full").status == "PASS"
    assert grpo_report.check_generation_all_reduces("loopback", synced, None, "full").status == "FAIL"
    checked = status(grpo_report.check_targets(results([quiet])), "[loopback] full/windowed: generation issues")
    assert list(checked.values()) == [("PASS", "generation's all-reduces on every timed step: [0]")]


def test_where_generation_draws_windowed_issues_one_all_reduce_per_generation():
    """LoRA's dropout is active in TRL's generation: windowed skips transformers' sync and ends each
    generation with one all-reduce (how many forwards the rank done first replays); none, or
    stock's per-token count, is not a pass."""
    stock, window = row("lora/stock", [1.0], [0]), row("lora/windowed", [1.0], [0])
    stock.counts_seen["generation"]["all_reduces"] = [29, 33]
    window.counts_seen["generation"]["all_reduces"] = [1]
    assert grpo_report.check_generation_all_reduces("loopback", window, stock, "lora").status == "PASS"
    assert grpo_report.check_generation_all_reduces("loopback", window, None, "lora").status == "PASS"
    for seen in ([0], [29, 33], [1, 33]):
        window.counts_seen["generation"]["all_reduces"] = seen
        assert grpo_report.check_generation_all_reduces("loopback", window, stock, "lora").status == "FAIL"


def test_a_resident_reference_model_is_gathered_at_step_1_and_never_after():
    """Counted on every step of every round: each of its units once at step 1, then 0; one all-gather
    at any later step (resharded after its pass) fails, and so does none at step 1 (never gathered
    where it was counted) or a second at step 1."""

    def reference(gathers, ref_units=1, beta=0.04):
        window = row("full/windowed", [1.0] * len(gathers), list(range(len(gathers))), ref_units=ref_units)
        window.logprob_gathers = gathers
        checked = grpo_report.check_targets(results([window], beta=beta))
        ((s, measured),) = status(checked, "[loopback] full/windowed: the reference model's").values()
        return s, measured

    s, measured = reference([[1, 0], [1, 0], [1, 0]])
    assert s == "PASS" and measured.endswith("steps 1, 2, ... of each round: 1, 0; 1, 0; 1, 0"), measured
    assert reference([[1, 0], [1, 1], [1, 0]])[0] == "FAIL"  # one round resharded it
    assert reference([[0, 0]])[0] == "FAIL"
    assert reference([[2, 0]])[0] == "FAIL"
    assert reference([[2, 0]], ref_units=2)[0] == "PASS"
    assert reference([[0, 0]], ref_units=0, beta=0.0) == ("SKIP", "beta 0: no reference model")
    assert reference([], ref_units=0)[0] == "SKIP"  # a results.json from before the count: nothing to judge
    # LoRA's windowed has no reference model of its own to keep: no such target.
    lora = row("lora/windowed", [1.0], [0])
    assert not status(grpo_report.check_targets(results([lora], beta=0.04)), "[loopback] lora/windowed: the reference")


def test_one_differing_loss_fails_the_identity_target():
    stock = row("full/stock", [1.0], [0])
    same, other = row("full/deferred", [1.0], [0]), row("full/windowed", [1.0], [0], loss=0.5000001)
    rows = {r.config: r for r in (stock, same, other)}
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "FAIL" and "full/windowed round 0: logs differ (step 1: loss 0.5000001 vs stock 0.5)" in measured
    rows["full/windowed"] = dataclasses.replace(same, config="full/windowed")
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows))]
    assert s == "PASS" and "logged loss, reward and recorded completions and rewards at every step" in measured


def test_kl_is_compared_and_must_be_logged_when_beta_is_positive():
    def with_kl(config, kl):
        r = row(config, [1.0], [0])
        r.logs = [[{"step": 1, "loss": 0.5, "reward": 0.5, "kl": kl}]]
        return r

    rows = {r.config: r for r in (with_kl("full/stock", 1e-4), with_kl("full/windowed", 1e-4))}
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows, 0.04))]
    assert s == "PASS" and "logged kl, loss, reward" in measured
    rows["full/windowed"] = with_kl("full/windowed", 1.1e-4)
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", rows, 0.04))]
    assert s == "FAIL" and "(step 1: kl 0.00011 vs stock 0.0001)" in measured
    # beta > 0 and no kl logged at all: the comparison would be vacuous.
    plain = {r.config: r for r in (row("full/stock", [1.0], [0]), row("full/windowed", [1.0], [0]))}
    ((s, measured),) = [(t.status, t.measured) for t in full_only(grpo_report.check_identical("loopback", plain, 0.04))]
    assert s == "FAIL" and "stock logged no kl" in measured


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


def full_only(checked):
    return [t for t in checked if "full:" in t.target]


def test_the_floor_says_what_the_collectives_alone_cost_on_the_network():
    """The backend's own price of windowed's pair (all-gather + reduce-scatter of the model) against
    DDP's all-reduce of the same bytes, in the floor target's line."""
    ddp, window = row("full/ddp", [1.0], [0]), row("full/windowed", [1.5], [0])
    backend = {"all_gather": 30.0, "reduce_scatter": 50.0, "all_reduce": 40.0}
    out = results([ddp, window], backend_ms=backend)
    ((_, measured),) = status(grpo_report.check_targets(out), "[loopback] full/windowed within 1.10x").values()
    assert measured.endswith("collectives alone: all-gather + reduce-scatter = 2.00x all-reduce of the same bytes")
    # A results.json from before the measurement: no note.
    plain = grpo_report.check_floor(GrpoRun(size="quick", facts={}, rows=[ddp, window]), "loopback", "full", False)
    assert "collectives alone" not in plain[0].measured


def test_a_frozen_base_kept_unsharded_is_said_and_left_out_of_the_windowed_targets():
    """keep_frozen_unsharded: the units kept for the run gather at step 1 only (U counts the
    others), and their bytes are said beside the state, which is compared without them."""
    kept = row("lora/windowed", [1.0], [0], gen_gathers=4, train_gathers=0, units=11, resident_units=7)
    assert grpo_report.check_windowed_gathers("loopback", kept).status == "PASS"
    measured = grpo_report.check_windowed_gathers("loopback", kept).measured
    assert "U = 4 (11 units, 7 kept unsharded for the run)" in measured, measured
    every = row("lora/windowed", [1.0], [0], gen_gathers=11, train_gathers=0, units=11, resident_units=7)
    assert grpo_report.check_windowed_gathers("loopback", every).status == "FAIL"  # the kept ones gathered again
    ddp = row("lora/ddp", [1.0], [0], state_bytes=4 * 2**20)
    window = row(
        "lora/windowed", [1.1], [0], state_bytes=6 * 2**20, resident_bytes=3 * 2**20, units=11, resident_units=7
    )
    ((state_status, state),) = status(
        grpo_report.check_targets(results([ddp, window])), "[loopback] lora/windowed: memory between"
    ).values()
    assert state_status == "PASS", state
    assert state.endswith("of it, the frozen base kept unsharded for the run: 3.00 MiB, without which 3.00 MiB"), state
