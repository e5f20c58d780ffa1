"""Edge cases of real training on 2 gloo ranks: every optimizer step's gradients must
equal a single-process unsharded fp32 reference (bf16 runs: within bf16 rounding), every FSDP2
unit's sync flags must come back as they were, and the reduce-scatters must be what the mode
issues, derived in the test from TinyNet's sizes (expected_counts.py), not from the plan.

One FSDP2 launch runs every schedule of SPECS (see workers/schedules.py) with a fresh model,
then the save_state/load_state scenario of workers/reliability_checkpoint.py. FSDP1 and DDP
run the exception and epoch schedules in launches of their own, marked slow."""

import json
import tempfile

import pytest
import torch
from expected_counts import expected_reduce_scatters
from launcher import accelerate_config, launch
from workers.schedules import ROUTES

from accel_gradsync.compat.fsdp2 import torch_series

DEFERRED, PMB = {"defer": True}, {}
BUDGET = {"sync_mode": "budget", "memory_budget": "1100B"}  # one Block's 1088 B gradient fits, not the head too
MODES = {"deferred": DEFERRED, "per_micro_batch": PMB, "budget": BUDGET}
WINDOWED = {**DEFERRED, "keep_params_unsharded": True}
BLOCK, HEAD = 16 * 16 + 16, 17  # TinyNet trainable elements: one Block unit, the root's head
# 11 micro-batches, M=3: an error after backward (k=1), a KeyboardInterrupt after backward at a
# non-final position of the next window (k=3), an error in forward (k=7) right after a step.
RAISES = [[0, 1, "after_backward"], [0, 3, "keyboard"], [0, 7, "forward"]]
M_FROM = [[2, 4], [4, 3], [5, 1]]  # [window, M]: accelerator.gradient_accumulation_steps set before it

SPECS = (
    [{"name": f"cond_{r}", "model": "cond", "route": r, "M": 3, "L": 6, "config": DEFERRED} for r in ROUTES]
    + [
        {"name": "cond_skip_final_budget", "model": "cond", "route": "skip_final", "M": 3, "L": 6, "config": BUDGET},
        {"name": "frozen", "model": "frozen", "M": 3, "L": 5, "config": DEFERRED},
        {"name": "m1_deferred", "M": 1, "L": 3, "config": DEFERRED},
        {"name": "epochs_deferred", "M": 3, "L": 7, "epochs": 2, "config": DEFERRED},
        {"name": "epochs_budget", "M": 3, "L": 7, "epochs": 2, "config": BUDGET},
    ]
    + [  # a forward with gradients and no backward after each window's last backward (a metric)
        {"name": f"extra_forward_{m}{'_no_grad' * (g == 'no_grad')}", "M": 2, "L": 6, "extra_forward": g, "config": c}
        for m, c in (("deferred", DEFERRED), ("windowed", WINDOWED))
        for g in (True, "no_grad")
    ]
    + [  # a loss guard skips backward and step: a held micro-batch (k=1), then a window's last (k=5)
        {"name": f"skip_{m}", "M": 3, "L": 9, "raises": [[0, 1, "skip"], [0, 5, "skip"]], "config": c}
        for m, c in (("deferred", DEFERRED), ("budget", BUDGET), ("windowed", WINDOWED))
    ]
    + [  # another model's optimizer steps between the last micro-batch's forward and backward
        {"name": f"{name}_windowed", "M": 2, "L": 6, "config": WINDOWED, **extra}
        for name, extra in (("other_step", {"other_step": True}), ("no_other_step", {}))
    ]
    + [  # accelerator.clip_grad_norm_ after every backward, not only where sync_gradients is True
        {"name": f"clip_every_{m}", "M": 3, "L": 6, "clip_every": True, "config": c}
        for m, c in (("deferred", DEFERRED), ("budget", BUDGET))
    ]
    + [  # a backward per half of each micro-batch, or two of one forward (the first retain_graph=True)
        {"name": f"backwards_{b}_{m}", "M": 3, "L": 6, "backwards": b, "config": c}
        for b in ("split", "retain")
        for m, c in (("deferred", DEFERRED), ("budget", BUDGET), ("windowed", WINDOWED))
    ]
    + [  # an evaluation (no_grad) after each held micro-batch; the loss averaged over ranks every micro-batch
        {"name": f"{k}_{m}", "M": 3, "L": 6, k: True, "config": c}
        for k in ("eval_mid", "log_every")
        for m, c in (("budget", BUDGET), ("windowed", WINDOWED))
    ]
    + [  # M set between optimizer steps: 2, 2, then 4, 4, then 3, then 1, 1
        {"name": f"m_changes_{m}", "M": 2, "L": 17, "M_from": M_FROM, "config": c}
        for m, c in (("budget", BUDGET), ("auto", {"sync_mode": "auto", "free_memory": "64GiB"}))
    ]
    + [{"name": f"raise_{m}", "M": 3, "L": 11, "raises": RAISES, "config": c} for m, c in MODES.items()]
    + [
        {"name": f"nozero_raise_{m}", "M": 3, "L": 11, "raises": RAISES, "config": c, "zero_grad_on_abort": False}
        for m, c in MODES.items()
    ]
    + [
        {
            "name": f"bf16_{mode}_reduce_{rd}",
            "M": 3,
            "L": 5,
            "param_dtype": "bf16",
            "attach_before_prepare": True,
            "config": {**cfg, "reduce_dtype": rd},
        }
        for rd in ("fp32", "bf16", "auto")  # auto: deferred and per_micro_batch keep the policy's (none)
        for mode, cfg in (("deferred", DEFERRED), ("per_micro_batch", PMB))
    ]
    + [
        # FSDP2's "expects uniform gradient dtype" case: bf16 compute, fp32 reduce, a parameter
        # whose first gradient of the step arrives on the final micro-batch.
        {
            "name": "bf16_cond_only_final",
            "model": "cond",
            "route": "only_final",
            "M": 3,
            "L": 6,
            "param_dtype": "bf16",
            "attach_before_prepare": True,
            "config": {"defer": True, "reduce_dtype": "fp32"},
        },
    ]
)
CHECKPOINT = {"per_micro_batch": PMB, "deferred": DEFERRED}


def _launch(config, specs, checkpoint=None):
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(specs, f)
        f.flush()
        args = ["--specs", f.name] + (["--checkpoint", json.dumps(checkpoint)] if checkpoint else [])
        return launch("reliability_edge", args, config, timeout=900)


@pytest.fixture(scope="module")
def fsdp2():
    return _launch(accelerate_config("fsdp2"), SPECS, CHECKPOINT)


def _runs(ranks, prefix):
    out = [(name, r) for rank in ranks for name, r in rank["runs"].items() if name.startswith(prefix)]
    assert out, prefix
    return out


def _exact(name, run, tol=1e-5):
    assert run["error"] is None, (name, run["error"])
    assert len(run["steps"]) == run["expected_steps"], (name, run["steps"])
    for step in run["steps"]:
        assert step["max_diff"] <= tol and not step["missing"] and not step["extra"], (name, step)


SPEC = {s["name"]: s for s in SPECS}


def _counts(name, run):
    got = [s["reduce_scatters"] for s in run["steps"]]
    assert got == expected_reduce_scatters(SPEC[name]), (name, got, run["plan"])


def _flags_and_memory(name, run):
    assert run["flags_between"] and run["flags_end"], name
    assert all(b == 0 for b in run["held_after_step"]), (name, run["held_after_step"])


# -- conditional computation ------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES + ("skip_final_budget",))
def test_conditional_computation_gradients_match_reference(fsdp2, route):
    for name, run in _runs(fsdp2, f"cond_{route}"):
        _exact(name, run)
        _flags_and_memory(name, run)
        repeated = [w for w in set(run["train_warnings"]) if run["train_warnings"].count(w) > 1]
        assert not repeated, repeated  # a fallback says so once, not every step


def test_first_gradient_on_final_micro_batch_under_bf16_with_fp32_reduce(fsdp2):
    """torch's FSDP2 fails here by itself ("expects uniform gradient dtype"): the plugin must
    keep training, with gradients right, and say so at most once per reason."""
    for name, run in _runs(fsdp2, "bf16_cond_only_final"):
        assert run["error"] is None, run["error"]
        assert len(run["steps"]) == run["expected_steps"]
        assert all(s["rel_err"] < 2e-2 and not s["missing"] for s in run["steps"]), run["steps"]
        assert len(run["train_warnings"]) == len(set(run["train_warnings"])), run["train_warnings"]
        _flags_and_memory(name, run)


# -- frozen parameters, M = 1, epochs -----------------------------------------------------------
def test_frozen_unit_holds_nothing_and_gradients_match(fsdp2):
    for name, run in _runs(fsdp2, "frozen"):
        _exact(name, run)
        _counts(name, run)
        assert sorted(run["plan"]["held"]) == ["", "blocks.1"]  # blocks.0 has nothing to reduce
        assert run["stats"]["peak_held_grad_bytes"] == (BLOCK + HEAD) * 4


def test_one_micro_batch_per_step_defers_nothing_and_stays_quiet(fsdp2):
    for name, run in _runs(fsdp2, "m1_deferred"):
        _exact(name, run)
        _counts(name, run)
        assert run["train_warnings"] == [] and len(run["attach_warnings"]) <= 1, run
        stats = run["stats"]
        assert stats["deferred_micro_batches"] == 0 and stats["reduce_scatters_skipped"] == 0
        assert stats["peak_held_grad_bytes"] == 0 and stats["optimizer_steps"] == 3


@pytest.mark.parametrize("mode", ["deferred", "budget"])
def test_epochs_with_a_short_last_window_sync_and_match(fsdp2, mode):
    for name, run in _runs(fsdp2, f"epochs_{mode}"):
        _exact(name, run)
        _counts(name, run)  # windows 3, 3, 1 per epoch
        # Deferred: one reduce-scatter per unit and step; the budget holds one Block: 3 x 3 - 2 in a
        # window of 3.
        got = [s["reduce_scatters"] for s in run["steps"]]
        assert got == {"deferred": [3, 3, 3] * 2, "budget": [7, 7, 3] * 2}[mode], (name, got)
        assert run["syncs_as_planned"]
        _flags_and_memory(name, run)
        assert run["stats"]["optimizer_steps"] == 6 and run["stats"]["micro_batches"] == 14


# -- an exception or KeyboardInterrupt in the middle of an accumulation --------------------------
@pytest.mark.parametrize("mode", ["deferred", "windowed"])
def test_a_forward_without_backward_before_the_step_leaves_nothing_stale(fsdp2, mode):
    """A forward after the last backward, with gradients or without, leaves FSDP2's root unsharded
    (and, with gradients under `keep_params_unsharded`, every unit the window kept through it);
    nothing so gathered may outlast the optimizer step, or the next forward runs on the
    parameters from before it."""
    for name, run in _runs(fsdp2, f"extra_forward_{mode}"):  # both: with gradients, and no_grad
        _exact(name, run)
        _counts(name, run)
        _flags_and_memory(name, run)


def test_another_models_optimizer_step_inside_a_micro_batch_reshards_nothing(fsdp2):
    """A GAN's other optimizer steps between the window's last forward and its backward, while
    the window keeps the units gathered for that backward: they are not stale (that optimizer
    updates none of them), so nothing is resharded and gathered again. All-gathers per step are
    those of the same schedule without that step, counted from outside; gradients exact."""
    for rank in fsdp2:
        with_step, without = rank["runs"]["other_step_windowed"], rank["runs"]["no_other_step_windowed"]
        _exact("other_step_windowed", with_step)
        _exact("no_other_step_windowed", without)
        got, want = [s["all_gathers"] for s in with_step["steps"]], [s["all_gathers"] for s in without["steps"]]
        assert got == want, (got, want)


@pytest.mark.parametrize("mode", ["deferred", "budget", "windowed"])
def test_a_loss_guard_that_skips_backward_and_step_trains_as_the_reference(fsdp2, mode):
    """`if not torch.isfinite(loss): continue` inside accumulate(): a skipped held micro-batch adds
    nothing and its window goes on; a skipped last one steps nothing, and what its window held or
    reduced counts into the next step, as in the single-process reference."""
    for name, run in _runs(fsdp2, f"skip_{mode}"):
        _exact(name, run)
        _counts(name, run)
        _flags_and_memory(name, run)
        assert run["syncs_as_planned"], name


@pytest.mark.parametrize("mode", ["deferred", "budget"])
def test_a_clip_in_every_micro_batch_is_said_where_it_clips_some_units_alone(fsdp2, mode):
    """A loop that clips after every backward: under budget (a Block held, the rest reduced every
    micro-batch) a clip inside the window would scale the reduced units' partial sums alone, as no
    stock configuration does, so it is said once; under deferred (every unit held, nothing to clip
    yet, as under accelerate's no_sync) nothing is said. The norm here is too large to scale: the
    gradients stay exact."""
    for name, run in _runs(fsdp2, f"clip_every_{mode}"):
        _exact(name, run)
        said = [w for w in run["train_warnings"] if "clip_grad_norm_ ran in a micro-batch" in w]
        if mode == "budget":
            assert len(said) == 1, run["train_warnings"]
            assert "holds 1 unit(s) and 2 reduce every micro-batch" in said[0], said
            assert "Clip only when accelerator.sync_gradients is True" in said[0], said
        else:
            assert said == [], said


@pytest.mark.parametrize("name", ["backwards_split", "backwards_retain", "eval_mid", "log_every"])
def test_more_backwards_evaluations_and_loop_collectives_in_a_window_are_exact_and_counted(fsdp2, name):
    """Two backwards in a micro-batch (a multi-task loop's, or two losses of one forward), an
    evaluation inside the window, a loss all-reduced for logging every micro-batch: gradients
    exact, and `stats()` says what ran, counted from outside (the logging all-reduce syncs no
    gradient: FSDP2 all-reduces none here). Windowed, the evaluation gathers nothing."""
    for run_name, run in _runs(fsdp2, name):
        _exact(run_name, run)
        _flags_and_memory(run_name, run)
        stats, steps = run["stats"], run["steps"]
        assert stats["reduce_scatters_issued"] == sum(s["reduce_scatters"] for s in steps), (run_name, stats)
        gathers = stats["all_gathers"] + stats["generation_all_gathers"]
        assert gathers == sum(s["all_gathers"] for s in steps), (run_name, stats)
        assert stats["all_reduces_issued"] == 0, (run_name, stats)
        if run_name == "eval_mid_window":
            assert [s["all_gathers"] for s in steps] == [3, 3], steps  # the window's one per unit


HSDP_SPECS = [
    {"name": f"clip_every_{m}", "M": 3, "L": 6, "clip_every": True, "config": c}
    for m, c in (("defer_all_reduce", {"sync_mode": "defer_all_reduce"}), ("deferred", DEFERRED))
]


@pytest.mark.slow  # four ranks
def test_a_clip_in_every_micro_batch_under_defer_all_reduce_is_said():
    """HSDP (2x2): under defer_all_reduce a clip inside the window would scale each replica group's
    reduce-scattered, not yet all-reduced, gradients by that group's own norm: said once; under
    deferred (nothing reduced yet) nothing is said. The norm here is too large to scale: exact."""
    config = accelerate_config("fsdp2", num_processes=4)
    config["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    for rank in _launch(config, HSDP_SPECS):
        for name, run in rank["runs"].items():
            _exact(name, run)
            said = [w for w in run["train_warnings"] if "clip_grad_norm_ ran in a micro-batch" in w]
            if name == "clip_every_defer_all_reduce":
                assert len(said) == 1 and "each replica group's partial gradients" in said[0], run["train_warnings"]
            else:
                assert said == [], said


@pytest.mark.parametrize("mode", ["budget", "auto"])
def test_accumulation_steps_changed_between_optimizer_steps(fsdp2, mode):
    """The modes that plan for M follow a user who sets `gradient_accumulation_steps` between
    steps: every step's gradients exact, each window's reduce-scatters those of its own M."""
    for name, run in _runs(fsdp2, f"m_changes_{mode}"):
        _exact(name, run)
        _counts(name, run)
        _flags_and_memory(name, run)
        assert run["syncs_as_planned"], name


@pytest.mark.parametrize("mode", list(MODES))
def test_aborted_accumulation_restores_flags_and_leaves_no_gradient(fsdp2, mode):
    for name, run in _runs(fsdp2, f"raise_{mode}"):
        assert run["error"] is None, run["error"]
        assert len(run["aborts"]) == len(RAISES)
        assert run["stats"]["aborted_steps"] == len(RAISES)  # each raise ends its window
        for abort in run["aborts"]:
            assert abort["flags_restored"], (name, abort)
            assert abort["held_after_zero_grad"] == 0, (name, abort)  # nothing left outside .grad
        _flags_and_memory(name, run)


@pytest.mark.parametrize("mode", list(MODES))
def test_after_an_abort_the_next_accumulation_starts_fresh_and_matches(fsdp2, mode):
    for name, run in _runs(fsdp2, f"raise_{mode}"):
        assert run["syncs_as_planned"], name  # M micro-batches, syncing on the last
        _exact(name, run)
        _counts(name, run)


@pytest.mark.parametrize("mode", list(MODES))
def test_abort_discards_the_window_even_without_the_users_zero_grad(fsdp2, mode):
    """The plugin says "its gradients were discarded" when an exception ends a window: then
    nothing of that window may reach the next step even if the handler does not zero_grad."""
    for name, run in _runs(fsdp2, f"nozero_raise_{mode}"):
        assert run["syncs_as_planned"], name
        _exact(name, run)


# -- mixed precision ---------------------------------------------------------------------------
# What FSDP2 holds and reduce-scatters in for fp32 params under a bf16 param_dtype: the policy's
# reduce dtype; without one (reduce_dtype "auto" leaves accelerate's plugin policy, here none)
# torch 2.13/2.14 use the compute dtype, torch 2.15 the parameter's ("versionchanged:: 2.15" of
# MixedPrecisionPolicy.reduce_dtype).
_WITHOUT_REDUCE = "bf16" if torch_series(torch.__version__) in ("2.13", "2.14") else "fp32"
HELD = {"fp32": "fp32", "bf16": "bf16", "auto": _WITHOUT_REDUCE}


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16", "auto"])
def test_bf16_params_match_reference_within_rounding(fsdp2, reduce_dtype):
    for rank in fsdp2:
        runs = {m: rank["runs"][f"bf16_{m}_reduce_{reduce_dtype}"] for m in ("deferred", "per_micro_batch")}
        for mode, run in runs.items():
            assert run["error"] is None, run["error"]
            assert len(run["steps"]) == run["expected_steps"]
            for step in run["steps"]:
                assert step["rel_err"] < (1e-2 if HELD[reduce_dtype] == "fp32" else 3e-2), (mode, step)
            # From the second step on: with an fp32 reduce the plugin syncs a unit's first micro-batch
            # (torch's FSDP2 cannot hold a not-yet-cast gradient before the unit has run once).
            got = [s["reduce_scatters"] for s in run["steps"]]
            assert got[1:] == expected_reduce_scatters(SPEC[f"bf16_{mode}_reduce_{reduce_dtype}"])[1:], (mode, got)
            _flags_and_memory(mode, run)
        # Deferral holds the unsharded gradient in the reduce dtype (FSDP2 casts it there).
        itemsize = 4 if HELD[reduce_dtype] == "fp32" else 2
        assert runs["deferred"]["stats"]["peak_held_grad_bytes"] == (2 * BLOCK + HEAD) * itemsize


def test_attach_before_prepare_binds_at_prepare(fsdp2):
    for name, run in _runs(fsdp2, "bf16_"):
        assert run["bound_at_prepare"], name


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(CHECKPOINT))
def test_save_state_mid_accumulation_does_not_disturb_training(fsdp2, mode):
    for rank in fsdp2:
        ck = rank["checkpoint"][mode]
        assert ck["save_and_continue"]["max_diff"] == 0.0, ck
        assert ck["save_and_continue_grads"] == [0.0] * ck["reference_steps"]


@pytest.mark.parametrize("mode", list(CHECKPOINT))
def test_resume_from_a_window_boundary_matches_uninterrupted_run(fsdp2, mode):
    for rank in fsdp2:
        ck = rank["checkpoint"][mode]
        assert ck["resume_boundary"]["max_diff"] <= 1e-6, ck
        assert ck["resume_boundary_steps"] == ck["reference_steps"] - 1


@pytest.mark.parametrize("mode", list(CHECKPOINT))
def test_resume_from_the_middle_of_a_window_loses_no_gradient(fsdp2, mode):
    for rank in fsdp2:
        ck = rank["checkpoint"][mode]
        assert ck["resume_middle_accelerate_step"] == 5  # accelerate restores its position
        assert ck["resume_middle"]["max_diff"] <= 1e-6, ck


@pytest.mark.parametrize("mode", list(CHECKPOINT))
def test_mid_window_save_state_keeps_this_ranks_gradients(fsdp2, mode):
    for rank in fsdp2:
        ck = rank["checkpoint"][mode]
        # accelerate saves no gradients; mid-window, each rank's held/sharded ones go beside them.
        assert [f for f in ck["files"]["middle"] if f.startswith("accel_gradsync_grads_rank")] == [
            "accel_gradsync_grads_rank0.pt",
            "accel_gradsync_grads_rank1.pt",
        ]
        assert not any(f.startswith("accel_gradsync") for f in ck["files"]["boundary"])
        assert not [w for w in ck["save_warnings"] if "save_state()" in w]


# -- FSDP1 and DDP -----------------------------------------------------------------------------
OTHER_SPECS = [
    {"name": "m1_deferred", "M": 1, "L": 3, "config": DEFERRED},
    {"name": "epochs_deferred", "M": 3, "L": 7, "epochs": 2, "config": DEFERRED},
    {"name": "raise_deferred", "M": 3, "L": 11, "raises": RAISES, "config": DEFERRED},
    {"name": "raise_per_micro_batch", "M": 3, "L": 11, "raises": RAISES, "config": PMB},
]


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["fsdp1", "ddp"])
def test_fsdp1_and_ddp_epochs_and_aborts(wrapper):
    ranks = _launch(None if wrapper == "ddp" else accelerate_config("fsdp1"), OTHER_SPECS)
    for rank in ranks:
        for name, run in rank["runs"].items():
            assert run["wrapper"] == wrapper
            _exact(name, run)
            assert run["syncs_as_planned"], name
            if wrapper == "fsdp1":
                _counts(name, run)
            assert all(a["held_after_zero_grad"] == 0 for a in run["aborts"]), run["aborts"]
            # FSDP1 keeps its sharded flat gradient after the optimizer's zero_grad (use_orig_params):
            # the level must stay flat, not grow.
            assert len(set(run["held_after_step"])) <= 1, (name, run["held_after_step"])
