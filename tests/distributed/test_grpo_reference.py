"""TRL's real GRPOTrainer with a KL term (beta 0.04) on 2 gloo ranks, FSDP2 (workers/grpo_reference.py):
TRL shards its reference model itself (one unit, `trl.models.prepare_fsdp`) and runs it once per
micro-batch's worth of completions without gradients, M forwards per step. With the plugin, in every
mode, the reference model all-gathers once per unit per step (counted from outside, by the param
group issuing each all-gather), is resharded before every training forward, stats() and the
decision line say so, and losses, KL, completions and rewards equal stock TRL's at every step.
Kept resident (`keep_reference_unsharded`), it all-gathers once in step 1 and never after, stays
gathered through training, and the end of training reshards it.
"""

from __future__ import annotations

import re

import pytest
from launcher import accelerate_config, launch

from accel_gradsync.estimator.core import estimate
from benchmarks import grpo

CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
M, STEPS = 3, 2


def runs(modes: list[str]) -> list[dict]:
    """Each rank's results by mode, stock first, from one launch."""
    args = ["--modes", ",".join(["stock", *modes]), "--micro-batches", str(M), "--steps", str(STEPS)]
    return launch("grpo_reference", args, CONFIG, timeout=900)


@pytest.mark.parametrize(
    "modes",
    [
        ["windowed", "windowed_resident"],
        pytest.param(["per_micro_batch", "deferred", "gather_for_generation"], marks=pytest.mark.slow),
    ],
)
def test_the_reference_model_gathers_once_per_step_and_changes_nothing(modes, tmp_path):
    grpo.build_model_dir(tmp_path, "quick")  # the worker's model, for `accel-gradsync estimate --beta`
    estimated = estimate(str(tmp_path), CONFIG, M, beta=0.04).reference
    for index, rank in enumerate(runs(modes)):
        stock = rank["stock"]
        units = stock["reference_groups"]
        assert units == 1  # TRL's prepare_fsdp: the whole model is one FSDP2 unit
        # Stock: one all-gather of the whole model per forward, M forwards per step.
        assert [s["reference"] for s in stock["steps"]] == [M * units] * STEPS, stock["steps"]
        for mode in modes:
            run = rank[mode]
            counted = [s["reference"] for s in run["steps"]]
            stats = run["stats"]
            assert stats["reference_all_gathers"] == sum(counted)
            assert stats["last_step/reference_all_gathers"] == counted[-1]
            assert run["reference_gathered_after_training"] == 0, mode  # the end of training reshards it
            if mode == "windowed_resident":
                # Gathered once, at its first forward, then never: no all-gather after step 1.
                assert counted == [units] + [0] * (STEPS - 1), run["steps"]
                assert stats["reference_models"]["ref_model"]["resident"] is True
                assert all(run["reference_gathered_in_training"]), run["reference_gathered_in_training"]
                if index == 0:
                    at = next(i for i, d in enumerate(run["decision"]) if "reference model ref_model" in d)
                    line, why = run["decision"][at : at + 2]
                    assert "1 all-gather at its first forward, then none: kept unsharded for the whole run" in line
                    assert why.startswith("grad sync:   why: keep_reference_unsharded=true"), why
                assert run["completions"] == stock["completions"]
                assert run["rewards"] == stock["rewards"]
                assert [e["kl"] for e in run["logs"]] == [e["kl"] for e in stock["logs"]]
                assert [e["loss"] for e in run["logs"]] == [e["loss"] for e in rank["windowed"]["logs"]]
                continue
            assert counted == [units] * STEPS, (mode, run["steps"])
            # The estimate says what is counted per step, with the plugin and stock, and the line the
            # main process prints.
            stock_counted = [s["reference"] for s in stock["steps"]]
            # Its first line; the second says why for the mode estimated (the default) and run.
            said = estimated.line.splitlines()[0]
            assert (counted, stock_counted, index > 0 or said in run["decision"]) == (
                [estimated.all_gathers_per_step] * STEPS,
                [estimated.stock_all_gathers_per_step] * STEPS,
                True,
            ), (mode, estimated, run["decision"])
            assert stats["reference_units"] == units
            assert not any(run["reference_gathered_in_training"]), mode  # resharded before training
            assert len(run["reference_gathered_in_training"]) == STEPS * M
            if index == 0:  # the decision line: the main process prints it
                line = next(d for d in run["decision"] if "reference model ref_model" in d)
                assert "1 all-gather per pass of forwards without gradients" in line, line
            # The same step, exactly: generation, rewards, KL and loss.
            assert run["completions"] == stock["completions"], mode
            assert run["rewards"] == stock["rewards"], mode
            assert [e["kl"] for e in run["logs"]] == [e["kl"] for e in stock["logs"]], mode
            assert [e["loss"] for e in run["logs"]] == pytest.approx([e["loss"] for e in stock["logs"]], rel=1e-5)


LINE = re.compile(
    r"generation (\d+) all-gathers per token after its first forward's (\d+)"
    r"(?: outside a window; inside one \(TRL generates in its first micro-batch\) (\d+) per token)?"
)
ROUND = re.compile(r"generation (\d+) all-gathers per round \(gather_for_generation")
T = 8  # forwards per generation round: the quick model never stops before max_completion_length


# (worker arguments, micro-batches, whether TRL generates inside a window's held micro-batch, the
# forwards of TRL's old-policy log-prob pass per round: one per micro-batch of the generation batch,
# run when a round serves more than one optimizer step)
PLACEMENTS = {
    "inside the window": ([], M, True, 0),
    "steps_per_generation = 2M": (["--steps-per-generation", str(2 * M)], M, True, 2 * M),
    "num_iterations = 2": (["--num-iterations", "2"], M, True, M),
    "outside any window (M = 1)": ([], 1, False, 0),
}


@pytest.mark.slow  # four launches of TRL, about a minute and a half each
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_decision_lines_generation_figures_are_what_runs(placement):
    """The generation figures of each mode's decision line, per round of T forwards, equal the
    all-gathers counted from outside in TRL's `_generate`, and each forward of its no-grad log-prob
    pass (num_iterations > 1) costs what a token does; stats() counts both as generation's."""
    extra, m, inside, logprob_forwards = PLACEMENTS[placement]
    modes = ["per_micro_batch", "windowed", "gather_for_generation"]
    args = ["--modes", ",".join(modes), "--micro-batches", str(m), "--steps", "2", "--beta", "0", *extra]
    (rank, *_) = launch("grpo_reference", args, CONFIG, timeout=900)
    for mode in modes:
        run = rank[mode]
        line = next(d for d in run["decision"] if not d.startswith("grad sync: reference model"))
        if (kept := ROUND.search(line)) is not None:
            first, per_token = int(kept[1]), 0
        else:
            found = LINE.search(line)
            assert found is not None, line
            per_token, first = int(found[1]), int(found[2])
            if found[3] is not None and inside:
                per_token = int(found[3])
        rounds = [s for s in run["steps"] if s["generation"]]
        assert len(rounds) == (1 if logprob_forwards else 2), run["steps"]  # a round per step, else one
        for step in rounds:
            assert step["generation"] == first + (T - 1) * per_token, (mode, line, run["steps"])
            # TRL's old-policy log-prob pass: each forward costs what a token does.
            assert step["logprob"] == logprob_forwards * per_token, (mode, line, run["steps"])
        counted = sum(s["generation"] + s["logprob"] for s in run["steps"])
        assert run["stats"]["generation_all_gathers"] == counted, mode
