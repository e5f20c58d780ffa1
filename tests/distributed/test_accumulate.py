"""Both sync modes under `accelerator.accumulate` on 2 gloo ranks, for FSDP2, FSDP1 and DDP:
real collective counts per optimizer step, the handle's counters, and gradients equal to a
single-process unsharded reference. 6 micro-batches per rank with M=4, so the second
optimizer step is the short last accumulation that ends with the dataloader."""

import json

import pytest
from launcher import accelerate_config, launch
from stats_keys import unregistered
from workers.common import DIM, TinyNet

M, BATCHES = 4, 6
WINDOWS = [4, 2]  # micro-batches per optimizer step: a full one, then the dataloader's end
# TinyNet's fp32 gradient bytes: two Blocks (a 16x16 Linear, 272 elements) and the root's 16->1
# head (17). FSDP1 pads each unit's flat parameter, and so its gradient, to a multiple of the 2 ranks.
BLOCK, HEAD = DIM * DIM + DIM, DIM + 1
GRADIENT_BYTES = {"fsdp2": (2 * BLOCK + HEAD) * 4, "fsdp1": (2 * BLOCK + HEAD + 1) * 4, "ddp": (2 * BLOCK + HEAD) * 4}
UNIT_NAMES = {
    "fsdp2": ["", "blocks.0", "blocks.1"],
    "fsdp1": ["", "_fsdp_wrapped_module.blocks.0", "_fsdp_wrapped_module.blocks.1"],
    "ddp": [""],
}


LOOPS = {
    "accumulate": None,  # accelerator.accumulate(model) around every micro-batch
    "no_sync": [  # accelerate's documented loop without accumulate(): no_sync(model) around the held ones
        {"name": "per_micro_batch", "config": {}, "loop": "no_sync"},
        {"name": "deferred", "config": {"defer": True}, "loop": "no_sync"},
    ],
    # Two forwards with gradients per micro-batch and one backward (siamese towers, a query and a
    # document pass): still one micro-batch, and one optimizer step per window.
    "two_forwards": [
        {"name": "per_micro_batch", "config": {}, "forwards": 2},
        {"name": "deferred", "config": {"defer": True}, "forwards": 2},
    ],
    "two_forwards_no_sync": [
        {"name": "per_micro_batch", "config": {}, "forwards": 2, "loop": "no_sync"},
        {"name": "deferred", "config": {"defer": True}, "forwards": 2, "loop": "no_sync"},
    ],
}


# The default suite: every wrapper in accumulate(), FSDP2 also with two forwards in no_sync; --slow: all.
PARAMS = [
    pytest.param(
        (w, loop),
        marks=() if loop == "accumulate" or (w, loop) == ("fsdp2", "two_forwards_no_sync") else pytest.mark.slow,
    )
    for loop in LOOPS
    for w in ("fsdp2", "fsdp1", "ddp")
]
# The compatibility suite (-m compat, on every stack in stacks/): FSDP2's and FSDP1's accumulate().
COMPAT = [("fsdp2", "accumulate"), ("fsdp1", "accumulate")]
PARAMS = [pytest.param(*p.values, marks=pytest.mark.compat) if p.values[0] in COMPAT else p for p in PARAMS]


@pytest.fixture(scope="module", params=PARAMS, ids=str)
def run(request):
    wrapper, loop = request.param
    config = None if wrapper == "ddp" else accelerate_config(wrapper)
    runs = [] if LOOPS[loop] is None else ["--runs", json.dumps(LOOPS[loop])]
    ranks = launch("accumulate", ["--M", str(M), "--batches", str(BATCHES), *runs], config)
    return wrapper, ranks


def _collective(wrapper):
    return ("all_reduce", "all_reduces") if wrapper == "ddp" else ("reduce_scatter_single", "reduce_scatters")


def test_model_is_wrapped_as_configured(run):
    wrapper, ranks = run
    assert [r["wrapper"] for r in ranks] == [wrapper, wrapper]


def test_gradients_match_single_process_reference(run):
    _, ranks = run
    for rank in ranks:
        for mode, res in rank["modes"].items():
            assert len(res["steps"]) == len(WINDOWS), mode
            for step in res["steps"]:
                assert step["max_diff"] <= 1e-5, (mode, step)


def _one_forward(ranks) -> bool:
    """Every run forwards the model once per micro-batch. With two, FSDP2 runs a unit's post-backward
    once per forward whose inputs need gradients, and each that finds a gradient reduces it: a
    held unit reduces twice in the window's last micro-batch (the held gradient, then the last
    micro-batch's own). The live counters are checked against what ran all the same."""
    return all(res.get("forwards", 1) == 1 for res in ranks[0]["modes"].values())


def test_collectives_per_step_follow_the_mode(run):
    wrapper, ranks = run
    fn, _ = _collective(wrapper)
    if not _one_forward(ranks):
        pytest.skip("the per-step figures of one forward per micro-batch")
    for rank in ranks:
        per_mb = [s["counts"].get(fn, 0) for s in rank["modes"]["per_micro_batch"]["steps"]]
        deferred = [s["counts"].get(fn, 0) for s in rank["modes"]["deferred"]["steps"]]
        # FSDP: one reduce-scatter per unit; DDP: one all-reduce per bucket, whatever DDP chose.
        units = TinyNet.UNITS if wrapper != "ddp" else deferred[0]
        assert units >= 1
        assert deferred == [units] * len(WINDOWS)  # U per optimizer step, the short one too
        assert per_mb == [m * units for m in WINDOWS]  # M x U


def test_live_counters_equal_real_collectives(run):
    wrapper, ranks = run
    _, key = _collective(wrapper)
    for rank in ranks:
        real = {mode: res["ran"].get(key, 0) for mode, res in rank["modes"].items()}
        # The handle counts unit syncs; DDP splits each whole-model sync into its buckets.
        per_sync = 1 if wrapper != "ddp" else real["deferred"] // len(WINDOWS)
        stats = {mode: res["stats"] for mode, res in rank["modes"].items()}
        for mode, res in rank["modes"].items():
            counted = res["counted"]  # over the training loop, as `ran`
            assert counted[f"{key}_issued"] * per_sync == real[mode], (mode, counted, res["ran"])
            if wrapper != "fsdp1":  # FSDP1's: test_fsdp1_live_all_gathers_equal_the_ones_that_ran
                gathers = counted["all_gathers"] + counted["generation_all_gathers"]
                assert gathers == res["ran"].get("all_gathers", 0), (mode, counted, res["ran"])
            assert counted["optimizer_steps"] == stats[mode]["optimizer_steps"] == len(WINDOWS), mode
            assert counted["micro_batches"] == stats[mode]["micro_batches"] == BATCHES, mode
            assert stats[mode]["last_step/micro_batches"] == WINDOWS[-1]
            # The last optimizer step's own, its last micro-batch's backward included.
            last = res["steps"][-1]["ran"]
            assert stats[mode][f"last_step/{key}_issued"] * per_sync == last.get(key, 0), (mode, last)
            if wrapper != "fsdp1":
                assert stats[mode]["last_step/all_gathers"] == last.get("all_gathers", 0), (mode, last)
        if _one_forward(ranks):
            assert stats["deferred"][f"{key}_skipped"] * per_sync == real["per_micro_batch"] - real["deferred"]
        assert stats["deferred"]["deferred_micro_batches"] == BATCHES - len(WINDOWS)
        assert stats["per_micro_batch"]["deferred_micro_batches"] == 0
        assert stats["per_micro_batch"][f"{key}_skipped"] == 0


def test_every_counter_against_outside_counts_and_the_models_sizes(run):
    """The counters no collective count covers, each against a figure of the test's own: the
    configured mode, TinyNet's units and gradient bytes, and for the last step the collectives
    counted from outside. A held micro-batch skips every unit's sync; the last one syncs them all."""
    wrapper, ranks = run
    if not _one_forward(ranks):
        pytest.skip("the per-step figures of one forward per micro-batch")
    names, gradient_bytes = UNIT_NAMES[wrapper], GRADIENT_BYTES[wrapper]
    for rank in ranks:
        for mode, res in rank["modes"].items():
            stats, last = res["stats"], res["steps"][-1]["ran"]
            deferred = mode == "deferred"
            assert (stats["mode"], stats["mode_selected"], stats["hsdp"]) == (mode, mode, False)
            assert stats["units"] == len(names) and stats["unit_modes"] == {n: mode for n in names}, stats
            assert (stats["units_per_micro_batch"], stats["units_deferred"]) == (
                (0, len(names)) if deferred else (len(names), 0)
            )
            # Every unit's gradient is reduced at each sync: on every micro-batch, or once per step.
            syncs, last_syncs = (len(WINDOWS), 1) if deferred else (BATCHES, WINDOWS[-1])
            assert stats["bytes_reduced"] == syncs * gradient_bytes, (mode, stats["bytes_reduced"])
            assert stats["last_step/bytes_reduced"] == last_syncs * gradient_bytes, mode
            held = WINDOWS[-1] - 1 if deferred else 0  # held micro-batches of the last step
            assert stats["last_step/deferred_micro_batches"] == held
            assert stats["last_step/held_grad_bytes"] == (gradient_bytes if deferred else 0), mode
            if wrapper == "ddp":  # one whole-model sync per micro-batch, split into DDP's buckets
                per_sync = res["ran"]["all_reduces"] // syncs
                assert stats["last_step/all_reduces_issued"] * per_sync == last["all_reduces"], (mode, last)
                assert stats["last_step/all_reduces_skipped"] == held
                assert stats["last_step/reduce_scatters_skipped"] == 0
            else:  # one reduce-scatter per unit sync; no all-reduce on a 1-D mesh: none issued, none to skip
                assert stats["reduce_scatters_issued"] == res["ran"]["reduce_scatters"], (mode, res["ran"])
                assert stats["last_step/reduce_scatters_issued"] == last["reduce_scatters"], (mode, last)
                assert stats["last_step/all_reduces_issued"] == last.get("all_reduces", 0) == 0, (mode, last)
                assert stats["last_step/all_reduces_skipped"] == stats["all_reduces_skipped"] == 0
                assert stats["last_step/reduce_scatters_skipped"] == held * len(names), mode
                assert stats["reduce_scatters_skipped"] == (BATCHES - len(WINDOWS) if deferred else 0) * len(names)
            # No forward without gradients in the loop, and no reference model bound.
            assert stats["last_step/generation_all_gathers"] == 0
            assert stats["last_step/all_gathers"] == last.get("all_gathers", 0), (mode, last)
            assert stats["reference_models"] == {} and stats["reference_units"] == 0


def test_fsdp1_all_gathers_counted_from_outside_follow_full_shard(run):
    """FSDP1 on CPU gathers each flat parameter with `dist.all_gather`, counted from outside like
    FSDP2's. FULL_SHARD gathers each Block in forward and again in backward, the root once per
    micro-batch: 5 per micro-batch, deferred or not, less one in the first step, whose root the
    forward without gradients before the loop left gathered (FSDP1 never reshards its root after
    forward)."""
    wrapper, ranks = run
    if wrapper != "fsdp1":
        pytest.skip("FSDP1's all-gathers; FSDP2's are in test_live_counters_equal_real_collectives")
    for rank in ranks:
        for mode, res in rank["modes"].items():
            ran = [s["ran"].get("all_gathers", 0) for s in res["steps"]]
            assert ran == [5 * m - (i == 0) for i, m in enumerate(WINDOWS)], (mode, ran)


def test_fsdp1_live_all_gathers_equal_the_ones_that_ran(run):
    wrapper, ranks = run
    if wrapper != "fsdp1":
        pytest.skip("FSDP1's all-gathers; FSDP2's are in test_live_counters_equal_real_collectives")
    for rank in ranks:
        for mode, res in rank["modes"].items():
            ran = [s["ran"].get("all_gathers", 0) for s in res["steps"]]
            counted = res["counted"]
            assert counted["all_gathers"] + counted["generation_all_gathers"] == sum(ran), (mode, counted, ran)
            assert res["stats"]["last_step/all_gathers"] == ran[-1], mode


def test_every_stats_key_has_a_test(run):
    """A counter added to stats() is registered in stats_keys.py with the test that checks it."""
    _, ranks = run
    for rank in ranks:
        for mode, res in rank["modes"].items():
            assert unregistered(res["stats"]) == [], mode


def test_fsdp2_restores_each_units_previous_flags(run):
    wrapper, ranks = run
    if wrapper != "fsdp2":
        pytest.skip("per-unit flags are FSDP2's")
    for rank in ranks:
        # (requires_gradient_sync, requires_all_reduce, reshard_after_backward) per unit
        flags = rank["flags"]
        assert flags["before"]["blocks.0"] == [False, False, True]  # switched off by the user
        assert all(v == [False, False, True] for v in flags["inside"].values())  # deferred
        assert flags["between"] == flags["inside"]  # set once per window, not around every micro-batch
        assert flags["after"] == flags["before"]  # back after the window's last forward, not blindly True
        assert all(v == [False, False, True] for v in flags["inside_raising"].values())
        assert flags["after_raise"] == flags["before"]
        assert all(v == [False, False, True] for v in flags["held_at_detach"].values())
        assert flags["after_detach"] == flags["before"]
        # detach() in the middle of a window that kept its params unsharded reshards them.
        shapes = {n: list(p.shape) for n, p in TinyNet().named_parameters()}
        assert rank["windowed_detach"] == {n: ["DTensor", shape] for n, shape in shapes.items()}
