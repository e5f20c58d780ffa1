"""Generation under FSDP2 on real gloo ranks: a tiny Qwen2 generates T tokens once per optimizer
step and trains on them (workers/generation.py).

- `gather_for_generation` (and `handle.gathered()`) all-gathers each unit once per generation
  round instead of once per unit per token, in every sync mode, with generation before the window
  (a plain loop, M = 1) or inside its first micro-batch (TRL); completions, losses and parameters
  equal the run without it.
- stats() counts training and generation all-gathers, and reduce-scatters, exactly as counted from
  outside (CollectiveCounter), frozen units included: a PEFT LoRA model (embeddings, head and the
  root frozen) and a model whose root unit is frozen.
- An exception inside generation (in a forward, after the forwards, inside `accumulate()`) leaves
  every unit resharded, and the next step is exact; generation retried inside a caller's `except`
  block is no forward that raised. After every step, frozen and LoRA models included, the units
  are resharded, the flags are back and the parameters equal the run without the setting.
- `gathered(model)` keeps that model only; a compiled model is named by the model inside.
- Under transformers' `Trainer` (accelerate's model, or one transformers sharded at load time)
  evaluation between steps and after the last leaves every unit resharded, and an exception
  inside the Trainer's `no_sync` discards the window's held gradients.
"""

import json

import pytest
from launcher import accelerate_config, launch

T, M, STEPS = 5, 2, 2
UNITS = 3  # two decoder layers and the root
CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
GEN = {"gather_for_generation": True}
WINDOWED = {"defer": True, "keep_params_unsharded": True}
MODES = {
    "per_micro_batch": {},
    "deferred": {"defer": True},
    "windowed": WINDOWED,
    "budget": {"sync_mode": "budget", "memory_budget": "1MiB"},
    "auto": {"sync_mode": "auto"},
}
RUNS = []
for name, config in MODES.items():
    RUNS += [{"name": name, "config": config}, {"name": f"{name}+gen", "config": {**config, **GEN}, "compare_to": name}]
RUNS += [
    # Generation inside the window's first held micro-batch, as TRL's GRPOTrainer does.
    {"name": "windowed_inside", "config": WINDOWED, "generate_at": "inside"},
    {
        "name": "windowed_inside+gen",
        "config": {**WINDOWED, **GEN},
        "generate_at": "inside",
        "compare_to": "windowed_inside",
    },
    {
        "name": "deferred_inside+gen",
        "config": {"defer": True, **GEN},
        "generate_at": "inside",
        "compare_to": "deferred",
    },
    # The context manager, with the setting off.
    {"name": "gathered", "config": {}, "gathered": True, "compare_to": "per_micro_batch"},
    # Exceptions: in a forward, after the forwards (inside gathered()), inside accumulate().
    {"name": "raise_in_forward", "config": GEN, "raise": "forward", "compare_to": "per_micro_batch"},
    {"name": "raise_in_gathered", "config": {}, "gathered": True, "raise": "between", "compare_to": "per_micro_batch"},
    {
        "name": "raise_in_accumulate",
        "config": {**WINDOWED, **GEN},
        "generate_at": "inside",
        "raise": "accumulate",
        "compare_to": "windowed_inside",
    },
]
# Each frozen model's runs compare to its deferred run without the setting: the window and
# generation change when units gather, never what trains.
FROZEN_RUNS = [
    {
        "name": f"{model}_{mode}{'+gen' * gen}",
        "model": model,
        "config": {**MODES[mode], **(GEN if gen else {})},
        **({"compare_to": f"{model}_deferred"} if (mode, gen) != ("deferred", False) else {}),
    }
    for model in ("lora", "frozen_root")
    for mode in ("deferred", "windowed")
    for gen in (False, True)
]
ONE = [
    {"name": "m1", "config": {"defer": True}},
    {"name": "m1+gen", "config": {"defer": True, **GEN}, "compare_to": "m1"},
]
HOSTILE_RUNS = [
    {"name": "per_micro_batch", "config": {}},
    # A retry after a failed attempt: every round generates inside the caller's `except` block.
    {"name": "in_except+gen", "config": GEN, "in_except": True, "compare_to": "per_micro_batch"},
    # gathered(model) beside a second bound model that generates in the same block.
    {"name": "gathered_beside_other", "config": {}, "gathered": True, "other": True, "compare_to": "per_micro_batch"},
    # torch.compile before fully_shard, as accelerate's dynamo_backend does.
    {"name": "compiled", "config": {"defer": True}, "compiled": True, "compare_to": "per_micro_batch"},
]
COMPARE = {r["name"]: r["compare_to"] for r in RUNS + ONE + FROZEN_RUNS + HOSTILE_RUNS if "compare_to" in r}
GATHERED = {"gathered", "raise_in_gathered", "gathered_beside_other"}


def _args(runs, m=M):
    return ["--runs", json.dumps(runs), "--M", str(m), "--steps", str(STEPS), "--tokens", str(T)]


# The default suite's share of RUNS and FROZEN_RUNS (each run with what it compares to); --slow runs all.
QUICK_RUNS = {
    "per_micro_batch",
    "per_micro_batch+gen",
    "windowed_inside",
    "windowed_inside+gen",
    "raise_in_forward",
}
QUICK_FROZEN = {"lora_deferred", "lora_window+gen"}


@pytest.fixture(scope="module")
def runs(slow):
    chosen = RUNS if slow else [r for r in RUNS if r["name"] in QUICK_RUNS]
    return launch("generation", _args(chosen), CONFIG, timeout=900)


@pytest.fixture(scope="module")
def frozen(slow):
    chosen = FROZEN_RUNS if slow else [r for r in FROZEN_RUNS if r["name"] in QUICK_FROZEN]
    return launch("generation", _args(chosen), CONFIG, timeout=900)


@pytest.fixture(scope="module")
def single():
    """M = 1: every micro-batch syncs, nothing is held; generation still gathers once."""
    return launch("generation", _args(ONE, m=1), CONFIG, timeout=900)


@pytest.fixture(scope="module")
def hostile():
    return launch("generation", _args(HOSTILE_RUNS), CONFIG, timeout=900)


def _gathers_once(run) -> bool:
    return "+gen" in run or run in GATHERED or run.startswith("raise_in")


def test_generation_gathers_each_unit_once_per_round_not_per_token(runs, single, hostile):
    for rank in runs + single + hostile:
        for name, out in rank["runs"].items():
            for step in out["steps"]:
                if _gathers_once(name):
                    assert 0 < step["gen_outside"] <= out["units"], (name, step)
                elif "inside" not in name:  # the window keeps its units through its first micro-batch
                    assert step["gen_outside"] >= (out["units"] - 1) * T, (name, step)
            # FSDP2's own pre- and post-forward run on a kept unit only at its first forward (its
            # records of post-forwards: one per param group per forward it runs them on).
            for records in out["fsdp_forward_records"]:
                if _gathers_once(name) or name.startswith("windowed_inside"):  # the window keeps them too
                    assert records <= out["units"], (name, out["fsdp_forward_records"])
                else:
                    assert records >= (out["units"] - 1) * T, (name, out["fsdp_forward_records"])
            if "+gen" in name:
                assert "all-gathers per round" in out["decision"], out["decision"]
            elif name in MODES:
                # A loop of its own: its line leaves generation out until a forward without
                # gradients, then says what generation all-gathers.
                assert "generation" not in out["decision"], out["decision"]
                assert "all-gathers per token" in out["decision_after"], out["decision_after"]
                if any(rank is ranks[0] for ranks in (runs, single, hostile)):  # main process: prints it once
                    said = [line for line in out["printed"] if ": generation " in line]
                    assert len(said) == 1 and "all-gathers per token" in said[0], out["printed"]


def test_stats_count_what_was_counted_from_outside(runs, single, frozen, hostile):
    for rank in runs + single + frozen + hostile:
        for name, out in rank["runs"].items():
            for step in out["steps"]:
                assert step["gen_stats"] == step["gen_outside"], (name, step)
                assert step["train_stats"] == step["train_outside"], (name, step)
                assert step["reduce_scatters_stats"] == step["reduce_scatters_outside"], (name, step)
                assert step["gen_stats_in_train"] == 0, (name, step)


def test_completions_losses_and_parameters_equal_the_run_without_it(runs, single, frozen, hostile):
    for rank in runs + single + frozen + hostile:
        outs = rank["runs"]
        for name, out in outs.items():
            if name not in COMPARE:
                continue
            ref = outs[COMPARE[name]]
            for step, ref_step in zip(out["steps"], ref["steps"], strict=True):
                assert step["completions"] == ref_step["completions"], name
                assert step["losses"] == pytest.approx(ref_step["losses"], rel=1e-6), name
            assert out["param_diff"] <= 1e-6, (name, out["param_diff"])


def test_units_are_sharded_after_every_step_and_after_an_exception(runs, single, frozen, hostile):
    for rank in runs + single + frozen + hostile:
        for name, out in rank["runs"].items():
            # Generation's flags sit on top of the window's: each set goes back exactly.
            assert out["flags_restored"], name
            assert all(step["sharded_after_step"] for step in out["steps"]), name
            if name.startswith("raise_in"):
                assert out["sharded_after_raise"] is True, name


def test_frozen_units_count_and_windowed(frozen):
    for rank in frozen:
        for name, out in rank["runs"].items():
            assert out["frozen_units"] >= 1, name
            if name.startswith("frozen_root"):
                assert out["frozen_units"] == 1 and out["units"] == UNITS, name
            stats = out["stats"]
            assert stats["units_frozen"] + stats["units_deferred"] + stats["units_windowed"] == out["units"] or (
                "windowed" in name and stats["units_windowed"] == out["units"]
            ), (name, stats)
            if "windowed" in name:  # frozen units are windowed too: every unit gathers once per step
                assert stats["units_windowed"] == out["units"], (name, stats)
                assert all(s["train_outside"] <= out["units"] for s in out["steps"]), (name, out["steps"])
            # A frozen unit reduces nothing: one reduce-scatter per trainable unit per step.
            trainable = out["units"] - out["frozen_units"]
            assert all(s["reduce_scatters_outside"] == trainable for s in out["steps"]), (name, out["steps"])


def test_a_no_grad_forward_inside_an_except_block_is_no_forward_that_raised(hostile):
    """Generation retried inside the caller's `except` block keeps its units through the round
    (the exception being handled is not one from the forward)."""
    for rank in hostile:
        out = rank["runs"]["in_except+gen"]
        assert all(0 < step["gen_outside"] <= out["units"] for step in out["steps"]), out["steps"]


def test_gathered_keeps_only_the_model_it_names(hostile):
    """A second bound model generating inside `gathered(model)` all-gathers every resharding
    unit per token and reshards it after each forward, as without the block."""
    for rank in hostile:
        out = rank["runs"]["gathered_beside_other"]
        assert len(out["other_gathers"]) == STEPS
        assert all(gathers >= (out["units"] - 1) * T for gathers in out["other_gathers"]), out["other_gathers"]
        assert all(out["other_sharded"]), out["other_sharded"]


def test_a_compiled_model_is_named_by_the_model_inside(hostile):
    for rank in hostile:
        out = rank["runs"]["compiled"]
        assert out["model_names"] == ["Qwen2ForCausalLM"], out["model_names"]
        assert "OptimizedModule" not in json.dumps(out["stats"]), out["stats"]


# -- transformers' Trainer: evaluation between steps and after the last, an exception in no_sync ----
TRAINER_RUNS = [
    {"name": "trainer", "entry": "trainer", "config": {}},
    {"name": "trainer+gen", "entry": "trainer", "config": GEN, "compare_to": "trainer"},
    {"name": "trainer_raise", "entry": "trainer", "config": {"defer": True}, "raise": True},
]
SHARDED_TRAINER_RUNS = [
    {"name": "trainer+gen", "entry": "trainer", "load": "transformers", "config": GEN},
    {"name": "trainer_raise", "entry": "trainer", "load": "transformers", "config": {"defer": True}, "raise": True},
]


@pytest.fixture(scope="module")
def trainer():
    """The Trainer on a model accelerate prepares."""
    return launch("generation", _args(TRAINER_RUNS), CONFIG, timeout=900)


@pytest.fixture(scope="module")
def trainer_sharded(tmp_path_factory):
    """The Trainer on a model transformers shards at load time (torchrun, no accelerate config)."""
    import torch
    from transformers import Qwen2ForCausalLM
    from workers.common import tiny_qwen2_config

    config = tiny_qwen2_config(
        vocab_size=32,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return launch("generation", [*_args(SHARDED_TRAINER_RUNS), "--model", str(path)], timeout=900)


def test_the_trainer_reshards_generation_units_after_each_evaluation_and_training(trainer, trainer_sharded):
    """Evaluation runs without gradients: with `gather_for_generation` it keeps its units through
    the evaluation, and they are resharded when it ends, between steps and after the last one."""
    for rank in trainer + trainer_sharded:
        for name, out in rank["runs"].items():
            if name == "trainer_raise":
                continue
            assert out["sharded_after_evaluate"] == [True] * STEPS, (name, out["sharded_after_evaluate"])
            assert out["sharded_after_train"], name
            assert out["flags_restored"] and out["sync_flags_restored"], name
    for rank in trainer:
        out, ref = rank["runs"]["trainer+gen"], rank["runs"]["trainer"]
        assert out["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-6)
        assert len(out["eval_losses"]) == STEPS
        assert out["param_diff"] <= 1e-6, out["param_diff"]
        assert out["stats"]["generation_all_gathers"] < ref["stats"]["generation_all_gathers"], (out, ref)


def test_an_exception_inside_the_trainers_no_sync_discards_the_window(trainer, trainer_sharded):
    """The first micro-batch fails after its backward, inside the Trainer's `no_sync` (accelerate's,
    or transformers' own deferral for a model it sharded): its held gradients are discarded and
    every flag is back, as when an exception leaves `accumulate()`."""
    for rank in trainer + trainer_sharded:
        out = rank["runs"]["trainer_raise"]
        assert out["held_before_raise"] > 0, out
        assert out["held_after_raise"] == 0, out
        assert out["sync_flags_restored"], out
        assert out["stats"]["aborted_steps"] == 1, out["stats"]


@pytest.mark.parametrize("kind", ["fsdp1", pytest.param("ddp", marks=pytest.mark.slow)])
def test_the_setting_warns_once_where_it_does_not_apply(kind):
    runs = [{"name": "gen", "config": {"defer": True, **GEN}}]
    config = accelerate_config("fsdp1") if kind == "fsdp1" else None  # torchrun: CPU DDP
    for rank in launch("accumulate", ["--runs", json.dumps(runs), "--M", "2", "--batches", "2"], config):
        assert rank["wrapper"] == kind
        warned = [w for w in rank["modes"]["gen"]["warnings"] if "gather_for_generation is ignored" in w]
        assert len(warned) == 1 and kind in warned[0], rank["modes"]["gen"]["warnings"]


# -- TRL's GRPOTrainer through the recipe ---------------------------------------------------------
GRPO = "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --grad-sync-log-all-counters"
PEFT = " --defer-grad-sync --grad-sync-gather-for-generation --use_peft --lora_r 8 --lora_target_modules q_proj v_proj"


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    from test_grpo_recipe import run_command

    flags = ("", " --grad-sync-gather-for-generation", PEFT)
    return {gen: run_command(GRPO + gen, tmp_path_factory.mktemp("grpo")) for gen in flags}


@pytest.mark.slow  # three recipe runs; the rounds themselves are counted in `runs` above
def test_grpo_recipe_gathers_per_round_not_per_token(grpo):
    """TRL generates inside the first micro-batch of each step (steps_per_generation = M): with the
    setting each unit is all-gathered once per round, counted from outside the recipe."""
    from test_grpo_recipe import STEPS

    off, on = grpo[""], grpo[" --grad-sync-gather-for-generation"]
    assert "all-gathers per round (gather_for_generation" in on["stdout"]
    assert "all-gathers per token" in off["stdout"]
    for run in (off, on):
        last = run["logs"][-1]
        for rank in run["ranks"]:
            gathered = sum(rank["counts"].get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor"))
            # Every all-gather of the run is a training or a generation one, as the plugin counted them.
            assert gathered == last["grad_sync/all_gathers"] + last["grad_sync/generation_all_gathers"], (rank, last)
    units = on["logs"][-1]["grad_sync/units"]
    assert on["logs"][-1]["grad_sync/generation_all_gathers"] <= STEPS * units
    assert off["logs"][-1]["grad_sync/generation_all_gathers"] >= 2 * STEPS * (units - 1)
    assert on["logs"][-1]["grad_sync/all_gathers"] <= off["logs"][-1]["grad_sync/all_gathers"]
    # Same seed: the same completions, rewards and loss with the units kept through generation.
    for first_on, first_off in zip(on["logs"], off["logs"], strict=True):
        assert first_on["reward"] == first_off["reward"]
        assert first_on["loss"] == pytest.approx(first_off["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_grpo_recipe_with_lora_counts_its_frozen_units(grpo):
    """Under LoRA the embeddings and head are frozen FSDP units: they reduce nothing but all-gather,
    in training and in generation; the counters equal what was counted from outside."""
    from test_grpo_recipe import STEPS

    run = grpo[PEFT]
    line = next(line for line in run["stdout"].splitlines() if line.startswith("grad sync:"))
    assert "frozen" in line and "all-gathers per round" in line, line
    last = run["logs"][-1]
    frozen, units = last["grad_sync/units_frozen"], last["grad_sync/units"]
    assert frozen >= 1
    for rank in run["ranks"]:
        counts = rank["counts"]
        gathered = sum(counts.get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor"))
        assert gathered == last["grad_sync/all_gathers"] + last["grad_sync/generation_all_gathers"], (rank, last)
        reduced = sum(counts.get(n, 0) for n in ("reduce_scatter_single", "reduce_scatter_tensor"))
        assert reduced == last["grad_sync/reduce_scatters_issued"] == STEPS * (units - frozen)
    assert last["grad_sync/generation_all_gathers"] <= STEPS * units
