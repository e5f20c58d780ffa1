"""The memory-aware modes on real gloo ranks: budget, auto, HSDP all-reduce deferral and
keep-params-unsharded give the reference gradients, the collectives derived from TinyNet's sizes
(expected_counts.py, not the plan), and never hold more than they were allowed to."""

import json

import pytest
from expected_counts import BLOCK, HEAD, held_within
from launcher import accelerate_config, launch
from stats_keys import unregistered
from workers.common import TinyNet

M, BATCHES = 4, 6
WINDOWS = [4, 2]
FULL = 2 * BLOCK + HEAD
BUDGETS = {"0B": 0, "100B": 100, "1100B": 1100, "1200B": 1200, f"{FULL}B": FULL}
MARGIN = 0.1  # GradSyncConfig.memory_margin's default: auto plans within 90% of the free bytes


def units_held_within(budget: int) -> int:
    """How many of TinyNet's units a plan within `budget` bytes defers (expected_counts.py)."""
    return len(held_within(budget))


# Units whose reduce-scatter / HSDP all-reduce each run holds on a micro-batch that does not end
# the step (auto: from step 2; step 1 syncs every micro-batch while it measures).
HELD = {
    "deferred": (3, 3),
    "keep_params": (3, 3),
    **{f"budget_{label}": (units_held_within(b),) * 2 for label, b in BUDGETS.items()},
    "budget_fraction": (units_held_within(1200),) * 2,  # 0.5 x 2400 B free
    "auto_small": (units_held_within(int(1000 * (1 - MARGIN))),) * 2,  # a 1000 B device, its peak 0 B
    "auto_ample": (3, 3),
    "auto_disagree": (units_held_within(int(1000 * (1 - MARGIN))),) * 2,  # the poorest rank decides
}
# HSDP: full deferral (2244 B) does not fit 90% of 1500 B, so auto defers only the all-reduce.
HSDP_HELD = {
    "per_micro_batch": (0, 0),
    "deferred": (3, 3),
    "defer_all_reduce": (0, 3),
    "windowed": (3, 3),
    "auto_only_all_reduce_fits": (0, 3),
}


def _runs(runs):
    return ["--M", str(M), "--batches", str(BATCHES), "--runs", json.dumps(runs)]


@pytest.fixture(scope="module")
def fsdp2():
    runs = [{"name": "deferred", "config": {"defer": True}}]
    runs += [{"name": "keep_params", "config": {"defer": True, "keep_params_unsharded": True}}]
    runs += [{"name": f"budget_{b}", "config": {"sync_mode": "budget", "memory_budget": b}} for b in BUDGETS]
    runs += [
        {"name": "budget_fraction", "config": {"sync_mode": "budget", "memory_budget": "0.5", "free_memory": "2400B"}}
    ]
    # auto plans from measured memory: a scripted device whose step-1 peak is 0 B, so the whole
    # capacity less the 10% margin is room.
    runs += [
        {"name": "auto_small", "config": {"sync_mode": "auto"}, "probe": {"capacity": 1000}},
        {"name": "auto_ample", "config": {"sync_mode": "auto"}, "probe": {"capacity": 2**30}},
        {"name": "auto_disagree", "config": {"sync_mode": "auto"}, "probe": {"capacity_by_rank": [2**30, 1000]}},
    ]
    return launch("accumulate", _runs(runs), accelerate_config("fsdp2"))


@pytest.fixture(scope="module")
def hsdp():
    config = accelerate_config("fsdp2", num_processes=4)
    config["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    runs = [
        {"name": "per_micro_batch", "config": {}},
        {"name": "deferred", "config": {"defer": True}},
        {"name": "defer_all_reduce", "config": {"sync_mode": "defer_all_reduce"}},
        {"name": "windowed", "config": {"defer": True, "keep_params_unsharded": True}},
        # Full deferral holds FULL bytes; all-reduce deferral only the sharded partial (about half).
        {"name": "auto_only_all_reduce_fits", "config": {"sync_mode": "auto"}, "probe": {"capacity": 1500}},
    ]
    return launch("accumulate", _runs(runs), config)


def _counts(res, name):
    return [s["counts"].get(name, 0) for s in res["steps"]]


def _expected(name, res, hsdp: bool):
    """Collectives per step from first principles: every unit syncs on each of a step's m
    micro-batches, a unit that holds skips m-1 of them (HELD, HSDP_HELD); auto syncs every
    micro-batch in step 1, while it measures."""
    units = TinyNet.UNITS
    rs_held, ar_held = (HSDP_HELD if hsdp else HELD)[name]
    first = 0 if "probe" in res else 1  # auto's first step holds nothing
    steps = [(m, i >= 1 - first) for i, m in enumerate(WINDOWS)]
    rs = [units * m - (rs_held * (m - 1) if holds else 0) for m, holds in steps]
    ar = [units * m - (ar_held * (m - 1) if holds else 0) for m, holds in steps] if hsdp else [0] * len(WINDOWS)
    return rs, ar


def _check_run(name, res, hsdp=False):
    for step in res["steps"]:
        assert step["max_diff"] <= 1e-5, step
    rs, ar = _expected(name, res, hsdp)
    assert _counts(res, "reduce_scatter_single") == rs, (name, res["plan"])
    # auto agrees on the measured peak with one small all-reduce at each window start after the first.
    agreement = [0] + [1] * (len(WINDOWS) - 1) if "probe" in res else [0] * len(WINDOWS)
    assert _counts(res, "all_reduce") == [a + b for a, b in zip(ar, agreement, strict=True)]
    stats = res["stats"]
    assert stats["reduce_scatters_issued"] == sum(rs) and stats["all_reduces_issued"] == sum(ar)


def test_every_mode_matches_reference_and_its_plans_collectives(fsdp2, hsdp):
    for rank in fsdp2:
        assert sorted(rank["modes"]) == sorted(HELD)
        for name, res in rank["modes"].items():
            _check_run(name, res)
    for rank in hsdp:
        assert sorted(rank["modes"]) == sorted(HSDP_HELD)
        for name, res in rank["modes"].items():
            _check_run(name, res, hsdp=True)


def test_every_stats_key_has_a_test(fsdp2, hsdp):
    """A counter added to stats() (auto's peaks and forecast, HSDP's all-reduces included) is
    registered in stats_keys.py with the test that checks it."""
    for rank in fsdp2 + hsdp:
        for name, res in rank["modes"].items():
            assert unregistered(res["stats"]) == [], name


def test_budget_holds_at_most_the_budget_and_saves_more_as_it_grows(fsdp2):
    for rank in fsdp2:
        skipped = []
        for label, budget in BUDGETS.items():
            res = rank["modes"][f"budget_{label}"]
            measured = res["stats"]["peak_held_grad_bytes"]
            # The gradient bytes of the units that fit, measured on the tensors.
            assert measured == sum(held_within(budget)) <= budget, (label, measured)
            skipped.append(res["stats"]["reduce_scatters_skipped"])
        assert skipped == sorted(skipped) and skipped[0] == 0 and skipped[-1] > skipped[1] > 0
        held = {name: sorted(res["plan"]["held"]) for name, res in rank["modes"].items()}
        assert held["deferred"] == ["", "blocks.0", "blocks.1"]
        # The full-deferral bytes buy full deferral: on 2 gloo ranks deferring a unit saves more per
        # byte it adds than its window would (test_policies_levels.py, costs.REDUCE_SCATTER_COST).
        assert held[f"budget_{FULL}B"] == held["deferred"] and rank["modes"][f"budget_{FULL}B"]["windowed"] == []
        # A fraction of free memory: 0.5 x 2400 B = 1200 B, the same units as the 1200 B budget.
        assert held["budget_fraction"] == held["budget_1200B"] == ["", "blocks.0"]


def test_auto_picks_by_free_memory_and_ranks_agree(fsdp2, hsdp):
    plans = [{k: r["modes"][k]["plan"] for k in ("auto_small", "auto_ample", "auto_disagree")} for r in fsdp2]
    for plan in plans:
        # 900 B usable: only the root's head fits, windowed (68 B of gradient + 68 B of params).
        assert plan["auto_small"]["mode"] == "budget" and plan["auto_small"]["held"] == [""]
        assert plan["auto_small"]["held_bytes"] <= 900
        assert plan["auto_ample"]["mode"] == "deferred"
        assert plan["auto_disagree"] == plan["auto_small"]  # the poorest rank decides
        assert "auto measured step 1" in plan["auto_small"]["reason"]
    assert plans[0] == plans[1]
    for rank in hsdp:
        plan = rank["modes"]["auto_only_all_reduce_fits"]["plan"]
        assert plan["mode"] == "defer_all_reduce", plan["reason"]


def test_hsdp_all_reduce_deferral_keeps_gradients_sharded(hsdp):
    for rank in hsdp:
        modes = rank["modes"]
        # The all-reduces counted from outside: each run issues its own, and skips what syncing
        # every micro-batch issues beyond them (the same loop); the last step's held micro-batches
        # skip one per unit each.
        ran = {n: _counts(modes[n], "all_reduce") for n in ("per_micro_batch", "deferred", "defer_all_reduce")}
        for name, all_reduces in ran.items():
            stats = modes[name]["stats"]
            assert stats["hsdp"] is True and stats["all_reduces_issued"] == sum(all_reduces), (name, stats)
            assert stats["all_reduces_skipped"] == sum(ran["per_micro_batch"]) - sum(all_reduces), (name, stats)
            held = (WINDOWS[-1] - 1) * TinyNet.UNITS if name != "per_micro_batch" else 0
            assert stats["last_step/all_reduces_skipped"] == held, (name, stats)
        assert modes["defer_all_reduce"]["stats"]["units_defer_all_reduce"] == TinyNet.UNITS
        assert modes["deferred"]["stats"]["units_defer_all_reduce"] == 0
        deferred = rank["modes"]["deferred"]["stats"]["peak_held_grad_bytes"]
        all_reduce_only = rank["modes"]["defer_all_reduce"]["stats"]["peak_held_grad_bytes"]
        assert deferred == FULL
        assert 0 < all_reduce_only < FULL / 2 + HEAD  # a shard of the partial sums, not the whole gradient
        assert all_reduce_only == rank["modes"]["defer_all_reduce"]["plan"]["held_bytes"]


def test_hsdp_windowed_gathers_each_unit_once_per_step(hsdp):
    for rank in hsdp:
        res = rank["modes"]["windowed"]
        gathers = _counts(res, "all_gather_single")
        assert gathers[1:] == [TinyNet.UNITS] * (len(WINDOWS) - 1) and gathers[0] <= TinyNet.UNITS
        assert res["flags_restored"] and res["sharded_after_step"]


def test_keep_params_unsharded_skips_the_next_forward_all_gathers(fsdp2):
    for rank in fsdp2:
        deferred = sum(_counts(rank["modes"]["deferred"], "all_gather_single"))
        kept = sum(_counts(rank["modes"]["keep_params"], "all_gather_single"))
        assert kept < deferred


@pytest.fixture(scope="module")
def bf16():
    config = {**accelerate_config("fsdp2"), "mixed_precision": "bf16"}
    runs = [
        {"name": "deferred", "config": {"defer": True}},
        *(
            {
                "name": f"deferred_{d}_reduce",
                "config": {"defer": True, "reduce_dtype": d},
                "attach_before_prepare": True,
            }
            for d in ("fp32", "bf16")
        ),
    ]
    return launch("accumulate", _runs(runs), config)


def test_reduce_dtype_sets_what_deferral_holds_and_warns_with_the_bytes(bf16):
    params = FULL // 4
    for rank in bf16:
        held = {name: res["stats"]["peak_held_grad_bytes"] for name, res in rank["modes"].items()}
        # bf16 params: accelerate reduces in bf16 (2 bytes/param); an fp32 reduce holds 4.
        assert held == {"deferred": 2 * params, "deferred_fp32_reduce": 4 * params, "deferred_bf16_reduce": 2 * params}
        for name, res in rank["modes"].items():
            assert res["plan"]["held_bytes"] == held[name]
            for step in res["steps"]:
                assert step["max_diff"] <= 5e-2  # bf16 compute against the fp32 reference
        (warning,) = [w for w in rank["modes"]["deferred_fp32_reduce"]["warnings"] if "wider" in w]
        assert "torch.float32" in warning and "1.1 KiB more" in warning  # 2 extra bytes for each of the 561 params
        assert not any("wider" in w for w in rank["modes"]["deferred"]["warnings"])
