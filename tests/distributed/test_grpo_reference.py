"""TRL's real GRPOTrainer with a KL term (beta 0.04) on 2 gloo ranks, FSDP2 (workers/grpo_reference.py):
TRL shards its reference model itself (one unit, `trl.models.prepare_fsdp`) and runs it once per
micro-batch's worth of completions without gradients, M forwards per step. With the plugin, in every
mode, the reference model all-gathers once per unit per step (counted from outside, by the param
group issuing each all-gather), is resharded before every training forward, stats() and the
decision line say so, and losses, KL, completions and rewards equal stock TRL's at every step.
"""

from __future__ import annotations

import pytest
from launcher import accelerate_config, launch

CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
M, STEPS = 3, 2


def runs(modes: list[str]) -> list[dict]:
    """Each rank's results by mode, stock first, from one launch."""
    args = ["--modes", ",".join(["stock", *modes]), "--micro-batches", str(M), "--steps", str(STEPS)]
    return launch("grpo_reference", args, CONFIG, timeout=900)


@pytest.mark.parametrize(
    "modes",
    [["window"], pytest.param(["per_micro_batch", "deferred", "gather_for_generation"], marks=pytest.mark.slow)],
)
def test_the_reference_model_gathers_once_per_step_and_changes_nothing(modes):
    for index, rank in enumerate(runs(modes)):
        stock = rank["stock"]
        units = stock["reference_groups"]
        assert units == 1  # TRL's prepare_fsdp: the whole model is one FSDP2 unit
        # Stock: one all-gather of the whole model per forward, M forwards per step.
        assert [s["reference"] for s in stock["steps"]] == [M * units] * STEPS, stock["steps"]
        for mode in modes:
            run = rank[mode]
            counted = [s["reference"] for s in run["steps"]]
            assert counted == [units] * STEPS, (mode, run["steps"])
            stats = run["stats"]
            assert stats["reference_units"] == units
            assert stats["reference_all_gathers"] == sum(counted)
            assert stats["last_step/reference_all_gathers"] == counted[-1]
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
