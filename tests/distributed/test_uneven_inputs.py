"""Uneven inputs on 2 gloo ranks: `grad_sync.join()` around a plain `accumulate` loop in which the
ranks run different numbers of micro-batches (M = 4). Every sync mode, FSDP2 and FSDP1, ends
without hanging at the parameters of the reference run in which the rank that ran out goes on
with its last micro-batch x 0 (bit for bit): one rank running out in the middle of a window
(8 and 7 micro-batches) and one at a window's boundary (4 and 8: the main process shadows a whole
window). The loop clips gradients at every optimizer step. The poll is one all-reduce per micro-batch and
per clip, plus one to leave, counted from outside.
A rank with no micro-batch, an evaluation inside join(), a generation inside a micro-batch,
`even_batches=False` (a prepared DataLoader would end each rank's window apart) and uneven counts
without join() met by `wait_for_everyone()` or `save_state()` are refused on every rank in one
line."""

import json

import pytest
from launcher import WORKERS, accelerate_config, launch

from testbed.launch import launch as launch_ranks

M = 4
CASES = {"mid_window": [8, 7], "boundary": [4, 8]}
MODES = {
    "per_micro_batch": {},
    "deferred": {"defer": True},
    "windowed": {"defer": True, "keep_params_unsharded": True},
    "budget": {"sync_mode": "budget", "memory_budget": "1200B"},  # holds the root and blocks.0 of TinyNet
    "auto": {"sync_mode": "auto", "free_memory": "64GiB"},  # plans step 2 from step 1's measure, in the window
}
FSDP1_MODES = ("per_micro_batch", "deferred")  # budget is FSDP2's; FSDP1 ignores the window
TIMEOUT = 300  # a hang fails the launch instead of the suite
HANG = 20  # seconds from its start a run that must hang waits before its ranks print their stacks
METRIC_TIMEOUT = 90  # the launch takes about 10 s; a hang ends here


def _runs(modes, cases=tuple(CASES)):
    runs = []
    for mode in modes:
        for case in cases:
            ref, counts = f"{mode}/{case}/reference", CASES[case]
            runs.append({"name": ref, "config": MODES[mode], "counts": counts, "pad": True})
            runs.append(
                {"name": f"{mode}/{case}/join", "config": MODES[mode], "counts": counts, "join": True, "reference": ref}
            )
    return runs


# The default suite's share: the window (its flags kept across a rank's leaving) both ways, budget
# in the middle of a window; --slow: every mode both ways, and FSDP1.
SHORT = _runs(["windowed"]) + _runs(["budget"], ["mid_window"])


def _pair(name: str, **run) -> list[dict]:
    """A join run named `name` and its padded reference."""
    return [
        {"name": f"{name}/reference", "pad": True, **run},
        {"name": name, "join": True, "reference": f"{name}/reference", **run},
    ]


# What a loop does around join() beyond the plain accumulate loop: each scheduler (the runs above
# step a prepared one every micro-batch), per epoch with join() around each epoch, a loop without
# accumulate() (M = 1 and 4), a loss logged through each loop collective, a metric forward, a clip
# after every micro-batch.
LOOPS = {
    "scheduler_unprepared_step": {"config": MODES["deferred"], "counts": [3, 21], "scheduler": "unprepared_step"},
    "scheduler_prepared_epoch": {
        "config": MODES["windowed"],
        "counts": [[6, 9], [9, 6]],
        "epochs": 2,
        "scheduler": "prepared_epoch",
    },
    "scheduler_unprepared_epoch": {
        "config": MODES["deferred"],
        "counts": [[6, 9], [9, 6]],
        "epochs": 2,
        "scheduler": "unprepared_epoch",
    },
    "scheduler_none": {"config": MODES["budget"], "counts": [8, 7], "scheduler": "none"},
    "no_accumulate_M1": {"config": {}, "counts": [5, 3], "accumulate": False, "M": 1},
    "no_accumulate_M4": {"config": {}, "counts": [5, 3], "accumulate": False},
    "log_gather": {"config": MODES["deferred"], "counts": [8, 7], "log": "gather"},
    "log_reduce": {"config": MODES["windowed"], "counts": [8, 7], "log": "reduce"},
    "log_gather_for_metrics": {"config": {}, "counts": [7, 8], "log": "gather_for_metrics"},
    # A forward without gradients after each step's last backward (a metric): a rank that left forwards too.
    "metric_mid_window": {"config": MODES["per_micro_batch"], "counts": [8, 7], "metric": "no_grad"},
    "metric_boundary": {"config": MODES["windowed"], "counts": [4, 8], "metric": "no_grad"},
    # A clip after every micro-batch (a loop that always clips): a rank that left clips the model's
    # parameters as they are then, not a list kept from a held micro-batch (the window keeps its units
    # unsharded there, and FSDP2 swaps their registered parameters).
    "clip_every_mid_window": {"config": MODES["windowed"], "counts": [8, 7], "clip_every": True},
}
DDP_LOOPS = ("scheduler_unprepared_step", "scheduler_prepared_epoch", "no_accumulate_M1", "log_gather")
DDP_LOOPS += ("metric_mid_window",)


METRIC_LOOPS = ("metric_mid_window", "metric_boundary")  # a launch of their own: a hang ends in 90 s


def _loop_runs(names) -> list[dict]:
    return [run for name in names for run in _pair(name, **LOOPS[name])]


REFUSALS = [
    {"name": "empty_rank", "config": {"defer": True}, "counts": [8, 0], "join": True},
    {"name": "evaluate_inside", "config": {"defer": True}, "counts": [3, 2], "join": True, "evaluate_after": 2},
    # A prepared DataLoader would end each rank's window at its own end: refused at join().
    {"name": "even_batches_false", "config": {"defer": True}, "counts": [2, 1], "join": True, "even_batches": False},
    # A window's held micro-batches issue no collective: the 7th reaches wait_for_everyone() silently.
    {"name": "uneven_without_join", "config": MODES["windowed"], "counts": [7, 6]},
    {"name": "uneven_at_save_state", "config": MODES["windowed"], "counts": [7, 6], "check": "save_state"},
    # Rank 0 saves at its third micro-batch, when rank 1 (two) already shadows it.
    {"name": "save_state_inside", "config": {"defer": True}, "counts": [3, 2], "join": True, "save_at": 2},
]


@pytest.fixture(scope="module")
def fsdp2(slow):
    runs = (_runs(MODES) if slow else SHORT) + _loop_runs([n for n in LOOPS if n not in METRIC_LOOPS]) + REFUSALS
    return launch(
        "uneven_inputs", ["--M", str(M), "--runs", json.dumps(runs)], accelerate_config("fsdp2"), timeout=TIMEOUT
    )


@pytest.fixture(scope="module")
def metric():
    args = ["--M", str(M), "--runs", json.dumps(_loop_runs(METRIC_LOOPS))]
    return launch("uneven_inputs", args, accelerate_config("fsdp2"), timeout=METRIC_TIMEOUT)


@pytest.fixture(scope="module")
def fsdp1():
    runs = _runs(FSDP1_MODES)
    return launch(
        "uneven_inputs", ["--M", str(M), "--runs", json.dumps(runs)], accelerate_config("fsdp1"), timeout=TIMEOUT
    )


@pytest.fixture(scope="module")
def ddp():
    runs = _loop_runs(DDP_LOOPS) + [
        # DDP's held micro-batches issue no collective: the 7th reaches wait_for_everyone() silently.
        {"name": "uneven_without_join", "config": {"defer": True}, "counts": [7, 6]},
    ]
    return launch("uneven_inputs", ["--M", str(M), "--runs", json.dumps(runs)], timeout=TIMEOUT)


def _check_loops(ranks, names):
    for r, rank in enumerate(ranks):
        for name in names:
            join, ref = rank["runs"][name], rank["runs"][f"{name}/reference"]
            assert join["error"] is None and ref["error"] is None, (name, join, ref)
            assert join["equal"], (name, join["max_diff"])
            # Every rank steps with the same learning rate, the one the padded run ends at.
            assert join["lr"] == join["reference_lr"], (name, join["lr"], join["reference_lr"])
            # Each rank logs its own micro-batches, as the padded run does: a rank that left
            # gave the others' gathers the zeros a loss x 0 gives.
            logs = LOOPS[name]["counts"][r] if "log" in LOOPS[name] else 0
            assert join["logged"] == ref["logged"][:logs] and len(join["logged"]) == logs, name
    lrs = [[rank["runs"][name]["lr"] for rank in ranks] for name in names]
    assert all(len(set(per_rank)) == 1 for per_rank in lrs), lrs


def test_fsdp2_join_follows_every_scheduler_loop_style_and_logged_collective(fsdp2):
    _check_loops(fsdp2, [n for n in LOOPS if n not in METRIC_LOOPS])
    # From first principles: LambdaLR 1 / (1 + steps), stepped at each of the 21 // M optimizer steps.
    for rank in fsdp2:
        assert rank["runs"]["scheduler_unprepared_step"]["lr"] == 0.01 * (1.0 / (1 + 21 // M))
    # Rank 0 (8 micro-batches) gathers the last loss with rank 1, which left after 7: its share is
    # the zero a loss x 0 gives.
    gathered = fsdp2[0]["runs"]["log_gather"]["logged"]
    assert len(gathered) == 8 and gathered[-1][1] == 0.0 and gathered[-1][0] > 0, gathered


def test_fsdp2_a_metric_forward_after_the_backward_is_forwarded_by_a_rank_that_left_too(metric):
    """A forward without gradients after each step's last backward: announced in the poll, not
    replayed; the rank that left forwards the same model once, so the all-gathers pair (per micro-batch
    leaving mid-window, the window at a boundary), and the run ends at the padded run's parameters."""
    _check_loops(metric, METRIC_LOOPS)


def test_ddp_join_follows_schedulers_loop_style_and_logged_collectives(ddp):
    _check_loops(ddp, DDP_LOOPS)


def test_ddp_uneven_counts_without_join_are_refused_at_wait_for_everyone(ddp):
    for rank in ddp:
        error = rank["runs"]["uneven_without_join"]["error"]
        assert error is not None and "\n" not in error, error
        assert "rank 0: 7 micro-batches, rank 1: 6 micro-batches" in error and "grad_sync.join()" in error


@pytest.mark.slow  # waits out the worker's watchdog
def test_ddp_per_micro_batch_uneven_without_join_never_pairs_the_check_with_a_gradient_all_reduce():
    """Rank 0's 7th micro-batch all-reduces its gradients on the default group while rank 1 checks
    the counts at wait_for_everyone(): on a group of its own the check cannot pair with it (gloo
    would abort rank 1 with a collective mismatch), so both wait, the hang docs/modes.md names,
    until the worker's watchdog prints each rank's stack and ends the run."""
    runs = [{"name": "uneven_per_micro_batch", "config": {}, "counts": [7, 6], "watchdog_s": HANG}]
    done = launch_ranks(
        WORKERS / "uneven_inputs.py", ["--M", str(M), "--runs", json.dumps(runs)], None, nprocs=2, timeout=TIMEOUT
    )
    output = done.output
    assert "rank 1 ran 6 micro-batches and checks" in output, output[-3000:]
    assert output.count(f"Timeout (0:00:{HANG})!") == 2, output[-3000:]  # both ranks still waiting
    assert "in check" in output and "in backward" in output, output[-3000:]  # where each waits
    assert "preamble" not in output and "mismatch" not in output, output[-3000:]


def _check_join_equals_reference(ranks, modes):
    checked = 0
    for rank in ranks:
        for mode in modes:
            for case, counts in CASES.items():
                if f"{mode}/{case}/join" not in rank["runs"]:
                    continue  # not in the default suite's share
                checked += 1
                join, ref = rank["runs"][f"{mode}/{case}/join"], rank["runs"][f"{mode}/{case}/reference"]
                assert join["error"] is None and ref["error"] is None, (mode, case, join, ref)
                assert join["equal"], (mode, case, join["max_diff"])
                # Every rank counts the micro-batches it shadowed: both end with max(counts), two steps.
                assert (
                    join["stats"]
                    == ref["stats"]
                    == {
                        "micro_batches": max(counts),
                        "optimizer_steps": max(counts) // M,
                        # auto with room for everything plans deferral (every unit windowed).
                        "mode": "deferred" if mode in ("windowed", "auto") else mode,
                    }
                ), (mode, case)
                # One poll per micro-batch, the shadowed ones included, one per clip_grad_norm_ (every
                # optimizer step), and one to leave together.
                assert join["all_reduces"] - ref["all_reduces"] == max(counts) + max(counts) // M + 1, (mode, case)
    assert checked >= len(ranks) * 3  # the default share's three join runs on each rank, at least


def test_fsdp2_join_ends_where_the_loss_times_zero_reference_ends(fsdp2):
    _check_join_equals_reference(fsdp2, MODES)


@pytest.mark.slow
def test_fsdp1_join_ends_where_the_loss_times_zero_reference_ends(fsdp1):
    _check_join_equals_reference(fsdp1, FSDP1_MODES)


def test_a_rank_with_no_micro_batch_is_refused_on_every_rank(fsdp2):
    for rank in fsdp2:
        error = rank["runs"]["empty_rank"]["error"]
        assert error is not None and "\n" not in error, error
        assert "rank 0: 0 micro-batches, rank 1: 0 micro-batches (left the loop)" in error, error
        assert "at least one micro-batch inside join()" in error


def test_an_evaluation_inside_join_is_refused_on_every_rank(fsdp2):
    """Rank 0 evaluates after its third micro-batch, when rank 1 is already shadowing."""
    errors = [rank["runs"]["evaluate_inside"]["error"] for rank in fsdp2]
    assert "a forward of TinyNet outside accelerator.accumulate()" in errors[0], errors
    assert "another rank stopped inside join()" in errors[1], errors


def test_uneven_counts_without_join_are_refused_at_wait_for_everyone(fsdp2):
    for rank in fsdp2:
        error = rank["runs"]["uneven_without_join"]["error"]
        assert error is not None and "\n" not in error, error
        assert (
            "accelerator.wait_for_everyone()" in error and "rank 0: 7 micro-batches, rank 1: 6 micro-batches" in error
        )
        assert "grad_sync.join()" in error


def test_even_batches_false_with_sync_with_dataloader_is_refused_at_join(fsdp2):
    for rank in fsdp2:
        error = rank["runs"]["even_batches_false"]["error"]
        assert error is not None and "\n" not in error, error
        assert "even_batches=False" in error and "sync_with_dataloader=False" in error, error


def test_save_state_inside_join_is_refused_on_every_rank_before_a_file_is_written(fsdp2):
    errors = [rank["runs"]["save_state_inside"]["error"] for rank in fsdp2]
    assert "accelerator.save_state() inside grad_sync.join()" in errors[0], errors
    assert "another rank stopped inside join()" in errors[1], errors
    assert not any(rank["runs"]["save_state_inside"]["saved_inside"] for rank in fsdp2)


def test_uneven_counts_without_join_are_refused_at_save_state(fsdp2):
    """accelerate runs the save-state pre-hook after writing the model and optimizer files (their
    collectives pair: the 7th micro-batch issued none), then the check refuses on every rank."""
    for rank in fsdp2:
        error = rank["runs"]["uneven_at_save_state"]["error"]
        assert error is not None and "\n" not in error, error
        assert "accelerator.save_state()" in error and "rank 0: 7 micro-batches, rank 1: 6 micro-batches" in error


@pytest.mark.compat  # how transformers' generate passes its cache differs by release
def test_a_generation_inside_a_micro_batch_is_refused_on_every_rank():
    """transformers' generate inside each step's first micro-batch, inside join() (a tiny Qwen2,
    workers/token_sync.py; rank r runs r + 1 steps): a rank that left would replay the generation's
    forwards, their KV cache grown since, for each of the other's micro-batches (it hung until the
    launcher's timeout). Both ranks refuse at the generation's first forward, through the poll,
    and the run ends at once."""
    runs = [{"name": "join/inside", "config": {}, "at": "inside", "join": True}]
    config = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
    done = launch_ranks(WORKERS / "token_sync.py", ["--runs", json.dumps(runs)], config, timeout=120)
    assert done.returncode != 0 and "killed after" not in done.output, done.output[-3000:]
    says = "grad_sync.join(): a generation inside a micro-batch (Qwen2ForCausalLM forwarded with a KV cache)"
    refusals = [line.split(":", 1)[0] for line in done.output.splitlines() if says in line]
    assert sorted(refusals) == ["[rank0]", "[rank1]"], done.output[-3000:]
