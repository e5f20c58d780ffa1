"""Micro-batch counts that differ across ranks and change every step, on 2 gloo ranks:
`grad_sync.step(n)` around each optimizer step of a plain `accumulate` loop, the counts per step
[3, 1], [2, 4], [1, 1], [4, 2] (rank 0, rank 1), micro-batches of 1 to 3 rows scaled by the step's
samples over every rank. In every sync mode, FSDP2 (DDP, and with --slow FSDP1 and a 2x2 HSDP mesh
with four ranks' counts, in one more launch each), the run ends at the parameters of the padded run
(every rank runs the step's largest count, a rank past its own repeating its last micro-batch with
loss x 0) bit for bit, with the same config attached, and for the modes stock accelerate also runs
(deferred, windowed) at stock accelerate's padded run. Windowed (FSDP2) and under DDP's deferral the
collectives per step, counted from outside, are the same whatever the counts and nothing is
replayed; in the other modes each rank issues per step what the padded run issues. The decision
line says which of the two the plan is. `preempted()` asked after every micro-batch agrees at the
end of the step one rank was signalled in, on every rank at its own last micro-batch, replays or
none. A frozen reference model forwarded in every micro-batch is replayed with the trained one,
unless resident (auto keeps it). A training metric forwarded without gradients after the last
backward runs after the replays and sees the stepped parameters; one with gradients is refused
where a rank replays. Bad uses are refused in one line, on every rank where a count is wrong."""

import json
import time

import pytest
from launcher import WORKERS, accelerate_config, launch

from testbed.launch import launch as launch_ranks

COUNTS = [[3, 1], [2, 4], [1, 1], [4, 2]]
LARGEST = [max(c) for c in COUNTS]
TINYNET_UNITS = 3  # workers/common.py: two Blocks and the root
MODES = {
    "per_micro_batch": {},
    "deferred": {"defer": True},
    "windowed": {"defer": True, "keep_params_unsharded": True},
    "budget": {"sync_mode": "budget", "memory_budget": "1200B"},  # holds some units, not all
    "auto": {"sync_mode": "auto", "free_memory": "64GiB"},  # room for all: every unit windowed
    "defer_all_reduce": {"sync_mode": "defer_all_reduce"},  # HSDP only
}
FSDP2_MODES = [m for m in MODES if m != "defer_all_reduce"]
STOCK = ("deferred", "windowed")  # stock accelerate defers every unit: the same sums
# The plans whose step issues the same collectives whatever its count, from the step they start:
# window's first; auto's second (auto measures its first step per micro-batch, then windows every
# unit when all fits); DDP held at its root (no_sync).
FREE = {
    "fsdp2": {"windowed": 0, "auto": 1},
    "fsdp1": {},
    "ddp": {"deferred": 0, "windowed": 0},
    "hsdp": {"windowed": 0},
}
HSDP_COUNTS = [[3, 1, 2, 1], [2, 4, 1, 1], [1, 1, 1, 1], [4, 2, 3, 1]]  # a 2x2 mesh's four ranks
HSDP_MODES = ("per_micro_batch", "deferred", "windowed", "defer_all_reduce")
TIMEOUT = 300


def _runs(modes, counts=COUNTS) -> list[dict]:
    runs = [{"name": "stock/pad", "config": None, "counts": counts, "style": "pad"}]
    for mode in modes:
        runs.append({"name": f"{mode}/pad", "config": MODES[mode], "counts": counts, "style": "pad"})
        refs = [f"{mode}/pad", *(["stock/pad"] if mode in STOCK else [])]
        runs.append({"name": mode, "config": MODES[mode], "counts": counts, "style": "step", "references": refs})
    return runs


def _accelerate_alone(mode: str) -> dict:
    """accelerate's own count per step, without step(): a plan that makes uneven counts free."""
    refs = [f"{mode}/pad", "stock/pad"]
    return {
        "name": f"{mode}/accelerate",
        "config": MODES[mode],
        "counts": COUNTS,
        "style": "accelerate",
        "references": refs,
    }


# Where the replays run: at the clip (the runs above), else at the optimizer step inside the block,
# at the end of the block where the loop steps after it, at a loop collective before the step, at
# the clip after a loss.backward() of the loop's own, at the clip of a micro-batch of two forwards,
# of one with a backward per part of it, at a forward without gradients after the last backward (a
# metric, which then runs after them).
LOOPS = ("no_clip", "step_outside", "reduce_log", "loss_backward", "two_forwards", "split", "metric")


def _loop_runs(mode: str) -> list[dict]:
    runs = []
    for loop in LOOPS:
        common = {"config": MODES[mode], "counts": COUNTS, "loop": loop}
        runs.append({"name": f"{mode}/{loop}/pad", "style": "pad", **common})
        runs.append({"name": f"{mode}/{loop}", "style": "step", "references": [f"{mode}/{loop}/pad"], **common})
    # The first step's first micro-batch raises after its forward on every rank (rank 1's only one,
    # held and recorded to replay): the step is dropped, the next ones train as the padded run's.
    common = {"config": MODES[mode], "counts": COUNTS, "raise_at": 0}
    runs.append({"name": f"{mode}/raise/pad", "style": "pad", **common})
    runs.append({"name": f"{mode}/raise", "style": "step", "references": [f"{mode}/raise/pad"], **common})
    return runs


REFUSALS = [
    {"name": f"refuse/{what}", "config": MODES["deferred"], "refuse": what}
    for what in (
        "zero_on_one_rank",
        "nested",
        "inside_join",
        "mid_window",
        "ran_other_count",
        "prepared_dataloader",
        "step_before_backward",
        "gather_every_micro_batch",
        "clip_every_micro_batch",
        "forward_between_micro_batches",
    )
]


def _preempted_runs(mode: str) -> list[dict]:
    """save_on_signal asked after every micro-batch, rank 1 signalled before step 2: every rank
    agrees at that step's end, saves its state inside the block and stops there; the reference
    pads the first two steps."""
    config = {**MODES[mode], "save_on_signal": "SIGUSR1"}
    pad = {"name": f"{mode}/pad2", "config": MODES[mode], "counts": COUNTS[:2], "style": "pad"}
    asks = {"config": config, "counts": COUNTS, "style": "step", "ask": True, "signal_at": 1, "save": True}
    return [pad, {"name": f"{mode}/preempted", "references": [pad["name"]], **asks}]


def _reference_runs(mode: str) -> list[dict]:
    """A frozen reference model (3 FSDP2 units, not trained) forwarded without gradients in every
    micro-batch, against the same loop padded."""
    common = {"config": MODES[mode], "counts": COUNTS, "loop": "reference"}
    pad = {"name": f"{mode}/reference/pad", "style": "pad", **common}
    return [pad, {"name": f"{mode}/reference", "style": "step", "references": [pad["name"]], **common}]


def _metric_runs(mode: str) -> list[dict]:
    """The model forwarded once more without gradients after the step's last backward, before the
    clip and the optimizer step (a training metric), against the same loop padded."""
    common = {"config": MODES[mode], "counts": COUNTS, "loop": "metric"}
    pad = {"name": f"{mode}/metric/pad", "style": "pad", **common}
    return [pad, {"name": f"{mode}/metric", "style": "step", "references": [pad["name"]], **common}]


def _evaluate_runs(mode: str) -> list[dict]:
    """The model forwarded without gradients after every micro-batch, outside accumulate() (an
    evaluation), against the same loop padded (which evaluates after its padding too)."""
    common = {"config": MODES[mode], "counts": COUNTS, "loop": "evaluate"}
    pad = {"name": f"{mode}/evaluate/pad", "style": "pad", **common}
    return [pad, {"name": f"{mode}/evaluate", "style": "step", "references": [pad["name"]], **common}]


@pytest.fixture(scope="module")
def fsdp2(compat_only):
    if compat_only:  # the compat test reads the modes' runs alone
        return launch(
            "uneven_steps", ["--runs", json.dumps(_runs(FSDP2_MODES))], accelerate_config("fsdp2"), timeout=TIMEOUT
        )
    runs = _runs(FSDP2_MODES) + [_accelerate_alone("windowed")] + _loop_runs("deferred") + REFUSALS
    runs += _preempted_runs("per_micro_batch") + _preempted_runs("windowed")
    runs += [run for mode in ("per_micro_batch", "windowed", "auto") for run in _reference_runs(mode)]
    runs += _evaluate_runs("windowed")
    return launch("uneven_steps", ["--runs", json.dumps(runs)], accelerate_config("fsdp2"), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def fsdp1():
    runs = _runs(("per_micro_batch", "deferred"))
    return launch("uneven_steps", ["--runs", json.dumps(runs)], accelerate_config("fsdp1"), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def hsdp():
    config = accelerate_config("fsdp2", num_processes=4)
    config["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    return launch("uneven_steps", ["--runs", json.dumps(_runs(HSDP_MODES, HSDP_COUNTS))], config, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ddp():
    runs = _runs(("per_micro_batch", "deferred", "windowed")) + [_accelerate_alone("deferred")]
    common = {"config": MODES["per_micro_batch"], "counts": COUNTS, "loop": "clip_every"}  # DDP's clip is local
    runs += [{"name": "clip_every/pad", "style": "pad", **common}]
    runs += [{"name": "clip_every", "style": "step", "references": ["clip_every/pad"], **common}]
    return launch("uneven_steps", ["--runs", json.dumps(runs)], timeout=TIMEOUT)


def _check(ranks: list[dict], wrapper: str, modes, counts=COUNTS) -> None:
    largest = [max(c) for c in counts]
    for r, rank in enumerate(ranks):
        runs = rank["runs"]
        for mode in modes:
            run, pad = runs[mode], runs[f"{mode}/pad"]
            assert run["error"] is None and pad["error"] is None, (mode, run["error"], pad["error"])
            assert run["equal"] and all(run["equal"].values()), (wrapper, mode, run["equal"])
            own = [c[r] for c in counts]
            free = FREE[wrapper].get(mode, len(counts))  # the first step that replays nothing
            replays = sum(largest[:free]) - sum(own[:free])
            stats = run["stats"]
            assert stats["optimizer_steps"] == len(counts), (mode, stats)
            assert stats["replayed_micro_batches"] == replays, (mode, stats)
            assert stats["micro_batches"] == sum(own) + replays, (mode, stats)
            assert stats["evened_micro_batches"] == sum(largest) - sum(own) - replays, (mode, stats)
            assert stats["last_step/fewest_micro_batches"] == min(counts[-1]), (mode, stats)
            assert stats["last_step/most_micro_batches"] == max(counts[-1]), (mode, stats)
            # Each step that replays issues what the padded run's step issues, collective for
            # collective; from `free` on, every step issues the same, whatever the counts.
            assert run["per_step"][:free] == pad["per_step"][:free], (mode, run["per_step"], pad["per_step"])
            assert len({json.dumps(s, sort_keys=True) for s in run["per_step"][free:]}) <= 1, (mode, run["per_step"])
            # The decision line says which of the two the plan is, once step(n) has run.
            says = "counts (step(n)) free" if mode in FREE[wrapper] else "replays its last micro-batch x 0"
            assert says in run["decision"], (mode, run["decision"])
            assert "per-rank" not in pad["decision"], pad["decision"]  # no step(n): not said
    for mode in modes:  # every rank issues the same collectives in every step: they pair
        assert all(rank["runs"][mode]["per_step"] == ranks[0]["runs"][mode]["per_step"] for rank in ranks), mode


@pytest.mark.compat  # holding, replaying and windowing read FSDP2's state, which differs by release
def test_fsdp2_every_mode_ends_at_the_padded_run_with_per_rank_counts(fsdp2):
    _check(fsdp2, "fsdp2", FSDP2_MODES)
    for r, rank in enumerate(fsdp2):  # from the counts alone: per micro-batch replays, window evens out
        own, last = [c[r] for c in COUNTS], COUNTS[-1]
        per, window = rank["runs"]["per_micro_batch"]["stats"], rank["runs"]["windowed"]["stats"]
        assert per["replayed_micro_batches"] == sum(LARGEST) - sum(own) and per["evened_micro_batches"] == 0
        assert per["last_step/replayed_micro_batches"] == max(last) - last[r], per
        assert window["evened_micro_batches"] == sum(LARGEST) - sum(own), window
        assert window["last_step/evened_micro_batches"] == max(last) - last[r], window
        assert window["last_step/fewest_micro_batches"] == min(last), window
        assert window["last_step/most_micro_batches"] == max(last), window
    # Window: from first principles, one all-gather and one reduce-scatter per unit and step.
    for rank in fsdp2:
        for step in rank["runs"]["windowed"]["per_step"]:
            assert step["all_gathers"] == step["reduce_scatters"] == TINYNET_UNITS, step


def test_fsdp2_replays_run_wherever_the_loop_steps(fsdp2):
    """deferred replays on the short rank: without a clip (at the optimizer step), stepping after
    the block (at its end), a loss summed over ranks before the step (at that collective), after
    loss.backward() and after two forwards (at the clip)."""
    for r, rank in enumerate(fsdp2):
        for loop in LOOPS:
            run, pad = rank["runs"][f"deferred/{loop}"], rank["runs"][f"deferred/{loop}/pad"]
            assert run["error"] is None and pad["error"] is None, (loop, run["error"], pad["error"])
            assert all(run["equal"].values()), (loop, run["equal"])
            assert run["per_step"] == pad["per_step"], (loop, run["per_step"], pad["per_step"])
            assert run["stats"]["replayed_micro_batches"] == sum(LARGEST) - sum(c[r] for c in COUNTS)
        # Each rank logs at its own last micro-batch (the padded run: its padding's zero on a short
        # rank), once per step; where the counts are equal ([1, 1]) the two runs log the same sum.
        logged = [rank["runs"]["deferred/reduce_log"]["logged"], rank["runs"]["deferred/reduce_log/pad"]["logged"]]
        assert len(logged[0]) == len(logged[1]) == len(COUNTS), logged
        even = COUNTS.index([1, 1])
        assert logged[0][even] == logged[1][even], logged
    assert fsdp2[0]["runs"]["deferred/reduce_log"]["logged"] == fsdp2[1]["runs"]["deferred/reduce_log"]["logged"]


def test_fsdp2_an_exception_in_a_step_drops_it_and_the_next_steps_train_as_padding_does(fsdp2):
    for r, rank in enumerate(fsdp2):
        run, pad = rank["runs"]["deferred/raise"], rank["runs"]["deferred/raise/pad"]
        assert run["error"] is None and pad["error"] is None, (run["error"], pad["error"])
        assert all(run["equal"].values()), run["equal"]
        assert run["per_step"][1:] == pad["per_step"][1:], (run["per_step"], pad["per_step"])
        # Steps 2 to 4 step the optimizer; the failed one neither steps nor replays.
        assert run["stats"]["optimizer_steps"] == len(COUNTS) - 1, run["stats"]
        assert run["stats"]["replayed_micro_batches"] == sum(LARGEST[1:]) - sum(c[r] for c in COUNTS[1:])


def test_fsdp2_preempted_asked_after_every_micro_batch_agrees_at_the_step_end_on_every_rank(fsdp2):
    for r, rank in enumerate(fsdp2):
        for mode in ("per_micro_batch", "windowed"):  # replays, and none
            run = rank["runs"][f"{mode}/preempted"]
            assert run["error"] is None and run["equal"] == {f"{mode}/pad2": True}, (mode, run)
            # True once, at this rank's own last micro-batch of the step the signal came before.
            assert run["preempted_at"] == [[1, COUNTS[1][r] - 1]], (mode, run["preempted_at"])
            # Saved there, inside the block, each rank at its own last micro-batch: the state dict's
            # collectives pair (nothing hangs), and the checkpoint holds files.
            assert len(run["saved"]) == 1 and run["saved"][0] > 0, (mode, run["saved"])
            assert run["stats"]["optimizer_steps"] == 2, run["stats"]


def test_fsdp2_a_reference_model_forwarded_every_micro_batch_replays_with_it_unless_resident(fsdp2):
    """The reference model's all-gathers depend on the count unless it stays unsharded: a short
    rank replays its forwards too (window's trained units are free, the reference is not); auto
    keeps it resident (room for it) and from its second step windows every unit: nothing replayed."""
    for r, rank in enumerate(fsdp2):
        own = [c[r] for c in COUNTS]
        for mode in ("per_micro_batch", "windowed", "auto"):
            run, pad = rank["runs"][f"{mode}/reference"], rank["runs"][f"{mode}/reference/pad"]
            assert run["error"] is None and all(run["equal"].values()), (mode, run["error"], run["equal"])
            free = {"auto": 1}.get(mode, len(COUNTS))  # the first step that replays nothing
            assert run["stats"]["replayed_micro_batches"] == sum(LARGEST[:free]) - sum(own[:free]), (mode, run)
            assert run["per_step"][:free] == pad["per_step"][:free], (mode, run["per_step"], pad["per_step"])
            assert len({json.dumps(s, sort_keys=True) for s in run["per_step"][free:]}) <= 1, (mode, run["per_step"])
    for mode in ("per_micro_batch", "windowed", "auto"):
        assert fsdp2[0]["runs"][f"{mode}/reference"]["per_step"] == fsdp2[1]["runs"][f"{mode}/reference"]["per_step"]


def test_fsdp2_an_evaluation_between_micro_batches_is_free_where_the_counts_are(fsdp2):
    """Windowed, an evaluation after every micro-batch (outside accumulate(), without
    gradients) runs a different number of times on each rank and issues nothing between the
    micro-batches (the window's units stay unsharded): each step issues what the padded run's does
    (which evaluates after its padding too), the same whatever the counts, and ends at its
    parameters. Under a plan that replays it is refused (test_bad_uses_are_refused_in_one_line)."""
    for rank in fsdp2:
        run, pad = rank["runs"]["windowed/evaluate"], rank["runs"]["windowed/evaluate/pad"]
        assert run["error"] is None and all(run["equal"].values()), (run["error"], run["equal"])
        assert run["per_step"] == pad["per_step"], (run["per_step"], pad["per_step"])
        assert len({json.dumps(s, sort_keys=True) for s in run["per_step"][1:]}) == 1, run["per_step"]
        assert all(step["reduce_scatters"] == TINYNET_UNITS for step in run["per_step"]), run["per_step"]
    assert fsdp2[0]["runs"]["windowed/evaluate"]["per_step"] == fsdp2[1]["runs"]["windowed/evaluate"]["per_step"]


METRIC_TIMEOUT = 90  # each launch takes about 10 s; a hang ends here


@pytest.fixture(scope="module")
def metric():
    runs = _metric_runs("per_micro_batch") + _metric_runs("windowed")
    return launch("uneven_steps", ["--runs", json.dumps(runs)], accelerate_config("fsdp2"), timeout=METRIC_TIMEOUT)


def test_fsdp2_a_metric_forward_after_the_last_backward_sees_the_stepped_params(metric):
    """A forward without gradients between the step's last backward and its optimizer step (a
    training metric): on a rank that replays, the replays run first, so its all-gathers pair with
    the other ranks' after their last micro-batch (else the ranks would hang); windowed, whose
    counts are free, nothing is replayed. Either way the units it left gathered are resharded at the
    step, so the next step reads the stepped root: the runs end at the padded run's parameters, bit
    for bit."""
    for rank in metric:
        for mode in ("per_micro_batch", "windowed"):
            run, pad = rank["runs"][f"{mode}/metric"], rank["runs"][f"{mode}/metric/pad"]
            assert run["error"] is None and all(run["equal"].values()), (mode, run["error"], run["equal"])
            if mode == "per_micro_batch":
                assert run["per_step"] == pad["per_step"], (run["per_step"], pad["per_step"])
    for mode in ("per_micro_batch", "windowed"):
        assert metric[0]["runs"][f"{mode}/metric"]["per_step"] == metric[1]["runs"][f"{mode}/metric"]["per_step"]


def test_a_forward_with_gradients_and_no_backward_after_the_last_is_refused_where_a_rank_replays():
    """The same metric forward with gradients on: it may belong to the micro-batch (a backward per
    part of it), so it is recorded, and its all-gathers ran while rank 0 was still in its second
    micro-batch. Rank 1 refuses at its replays and exits; the launcher ends the run long before
    the timeout."""
    runs = [{"name": "metric_grad", "config": MODES["deferred"], "counts": COUNTS, "style": "step"}]
    runs[0].update(loop="metric_grad", uncaught=True)
    says = "grad_sync.step(1): a forward with gradients after this rank's last micro-batch's backward"
    _check_refused_and_ended("uneven_steps", runs, accelerate_config("fsdp2"), METRIC_TIMEOUT, says, rank=1)


def _check_refused_and_ended(worker: str, runs: list[dict], config, timeout: int, says: str, rank: int) -> None:
    """The launch fails with one line saying `says`, from `rank`, and ends well before `timeout`
    (the launcher stops the other ranks once the refusing one exits)."""
    start = time.monotonic()
    done = launch_ranks(WORKERS / f"{worker}.py", ["--runs", json.dumps(runs)], config, timeout=timeout)
    took = time.monotonic() - start
    assert done.returncode != 0 and "killed after" not in done.output, done.output[-3000:]
    refusals = [line for line in done.output.splitlines() if says in line]
    assert len(refusals) == 1 and refusals[0].startswith(f"[rank{rank}]"), done.output[-3000:]
    assert took < timeout / 2, took


QWEN2 = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
GENERATE_COUNTS = [1, 2]  # rank 0's first micro-batch is its last
QWEN2_UNITS = 3  # tiny_qwen2_config: two decoder layers and the root
GENERATE_TIMEOUT = 120  # each launch takes about 10 s; a hang ends here


@pytest.fixture(scope="module")
def generating():
    """transformers' generate on a tiny Qwen2 (workers/token_sync.py, rank r asks for 3 + 4r new
    tokens), inside step(n): before the first micro-batch under a plan that replays; inside the
    first micro-batch windowed, where it is rank 0's last and rank 1's held one."""
    runs = [
        {"name": "stock", "config": {}, "at": "outside"},
        {"name": "replays/before", "config": {}, "at": "outside", "counts": GENERATE_COUNTS},
        {"name": "windowed/inside", "config": MODES["windowed"], "at": "inside", "counts": GENERATE_COUNTS},
    ]
    return launch("token_sync", ["--runs", json.dumps(runs)], QWEN2, timeout=GENERATE_TIMEOUT)


@pytest.mark.compat  # FSDP2's reshard flags and transformers' generate, which differ by release
def test_a_generation_before_the_first_micro_batch_or_with_every_unit_windowed_runs_with_per_rank_counts(generating):
    """Each rank generates what stock generates and trains its own count. Windowed, rank 0's
    generation sits in its last micro-batch: it gathers the units once, as rank 1's inside its
    held one does (not once per token, which would leave rank 1 waiting), and from the second
    step runs without transformers' per-token all-reduce on both (the first proves it free)."""
    for r, rank in enumerate(generating):
        stock = rank["runs"]["stock"]["steps"]
        for name in ("replays/before", "windowed/inside"):
            steps = rank["runs"][name]["steps"]
            assert steps[0]["completions"] == stock[0]["completions"], name  # the same model generated
            assert steps[0]["losses"][0] == pytest.approx(stock[0]["losses"][0], rel=1e-6), name
            assert [len(s["losses"]) for s in steps] == [GENERATE_COUNTS[r]] * len(steps), name
        window = [s["generate"] for s in rank["runs"]["windowed/inside"]["steps"]]
        assert [g["all_gathers"] for g in window] == [QWEN2_UNITS] * len(window), window
        assert [g["all_reduces"] for g in window[1:]] == [0] * (len(window) - 1), window
    for name in ("replays/before", "windowed/inside"):
        per_rank = [[s["generate"] for s in rank["runs"][name]["steps"]] for rank in generating]
        assert per_rank[0] == per_rank[1], (name, per_rank)  # each rank's generation issues the same


@pytest.mark.compat  # FSDP2's reshard flags and transformers' generate, which differ by release
def test_a_generation_inside_a_micro_batch_a_rank_replays_is_refused_and_the_run_ends():
    """Rank 0's only micro-batch generates under per_micro_batch: it would be replayed with its
    generation (a KV cache grown in place) while rank 1 generated once. Rank 0 refuses at the
    generation's first forward, before its all-gathers; rank 1, in that forward's all-gather, sees
    rank 0 gone and the launcher ends the run, long before the timeout."""
    runs = [{"name": "replays/inside", "config": {}, "at": "inside", "counts": GENERATE_COUNTS}]
    says = "grad_sync.step(1): this rank's last micro-batch generates (a forward of FSDPQwen2ForCausalLM with a KV"
    _check_refused_and_ended("token_sync", runs, QWEN2, GENERATE_TIMEOUT, says, rank=0)


def _check_accelerate_alone(ranks: list[dict], mode: str) -> None:
    for rank in ranks:
        run = rank["runs"][f"{mode}/accelerate"]
        assert run["error"] is None and run["equal"] and all(run["equal"].values()), run
        assert len({json.dumps(s, sort_keys=True) for s in run["per_step"]}) == 1, run["per_step"]
        assert run["stats"]["optimizer_steps"] == len(COUNTS), run["stats"]


def test_fsdp2_windowed_takes_accelerates_own_count_per_step_without_step(fsdp2):
    _check_accelerate_alone(fsdp2, "windowed")


def test_ddp_deferral_takes_accelerates_own_count_per_step_without_step(ddp):
    _check_accelerate_alone(ddp, "deferred")


@pytest.mark.slow  # 4 processes on 2 cores
def test_hsdp_every_mode_ends_at_the_padded_run_with_per_rank_counts(hsdp):
    """A 2x2 mesh: window's step reduce-scatters and all-reduces once per unit whatever the
    counts; all-reduce deferral (reduce-scatters every micro-batch) and the others replay."""
    _check(hsdp, "hsdp", HSDP_MODES, HSDP_COUNTS)
    for rank in hsdp:
        for step in rank["runs"]["windowed"]["per_step"]:
            assert step["all_gathers"] == step["reduce_scatters"] == TINYNET_UNITS, step


@pytest.mark.slow  # the same replays as DDP's, through FSDP1's no_sync
def test_fsdp1_every_mode_ends_at_the_padded_run_with_per_rank_counts(fsdp1):
    _check(fsdp1, "fsdp1", ("per_micro_batch", "deferred"))


def test_ddp_every_mode_ends_at_the_padded_run_with_per_rank_counts(ddp):
    _check(ddp, "ddp", ("per_micro_batch", "deferred", "windowed"))
    for rank in ddp:  # a clip after every micro-batch is local on DDP: not refused, as padded
        run = rank["runs"]["clip_every"]
        assert run["error"] is None and run["equal"] == {"clip_every/pad": True}, run
    for rank in ddp:  # held at the root: one all-reduce pass (TinyNet fits one bucket) per step
        assert {json.dumps(s) for s in rank["runs"]["deferred"]["per_step"]} == {
            json.dumps(rank["runs"]["deferred"]["per_step"][0])
        }


@pytest.mark.parametrize(
    ("what", "says", "every_rank"),
    [
        ("zero_on_one_rank", "n must be an int >= 1 on every rank", True),
        ("nested", "already active", True),
        ("inside_join", "inside grad_sync.join()", True),
        ("mid_window", "after 1 micro-batch of an accumulation window", True),
        ("ran_other_count", "this rank ran 1 micro-batch inside the block", True),
        ("prepared_dataloader", "sync_with_dataloader=False", True),
        # Every rank, at the block's end: the shorter one raising at the step would leave the other waiting.
        ("step_before_backward", "an optimizer step ran before the last micro-batch's backward", True),
        # Both ranks gather after micro-batch 1, before their last: each refuses there.
        ("gather_every_micro_batch", "accelerator.gather() after micro-batch 1 of this rank's", True),
        # A clip after every micro-batch: FSDP2's norm is an all-reduce; each refuses before it.
        ("clip_every_micro_batch", "accelerator.clip_grad_norm_() after micro-batch 1 of this rank's", True),
        # An evaluation after every micro-batch, outside accumulate(): each refuses before its all-gathers.
        ("forward_between_micro_batches", "a forward of FSDPTinyNet outside accumulate() after micro-batch 1", True),
    ],
)
def test_bad_uses_are_refused_in_one_line(fsdp2, what, says, every_rank):
    for rank in fsdp2 if every_rank else fsdp2[:1]:
        error = rank["runs"][f"refuse/{what}"]["error"]
        assert error is not None and says in error and "\n" not in error, (what, error)
