"""End to end: the README's quick-start commands, `accelerate launch` of recipes/grpo.py on 2 CPU
processes, FSDP2 and FSDP1, with and without --defer-grad-sync, a few optimizer steps each.

What the recipe logs is not taken on trust: `recipe_counter/sitecustomize.py` counts every
rank's real collectives and records which FSDP wrappers exist, from outside the script.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from launcher import REPO, recipe_launch

COUNTER = Path(__file__).parent / "recipe_counter"

# Exactly the commands the README's "GRPO recipe" quick-start shows (tests/recipes/test_recipe_readme.py
# checks that), in the order shown.
QUICKSTART = [
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync",
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py",
    "accelerate launch --config_file accelerate_configs/fsdp1.yaml recipes/grpo.py --defer-grad-sync",
    "accelerate launch --config_file accelerate_configs/fsdp1.yaml recipes/grpo.py",
]
STEPS = 2
MICRO_BATCHES = 4  # the recipe's default gradient_accumulation_steps
# Only what keeps the runs short and observable; everything else is the recipe's default.
TEST_FLAGS = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true"]


def run_command(command: str, tmp: Path, timeout: int = 300) -> dict:
    """Launch one quick-start command from the repo root; return exit, output, counters, logs."""
    argv = shlex.split(command)
    assert argv[:2] == ["accelerate", "launch"], command
    out_dir, counter_dir = tmp / "output", tmp / "counters"
    counter_dir.mkdir(parents=True)
    # recipe_counter's sitecustomize counts every rank's collectives from outside the script.
    env = {
        "RECIPE_COUNTER_DIR": str(counter_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")])),
    }
    cmd, env = recipe_launch([*argv[2:], *TEST_FLAGS, "--output_dir", str(out_dir)], env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{command} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    state = json.loads((out_dir / "trainer_state.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(counter_dir.glob("rank*.json"))]
    logs = [e for e in state["log_history"] if "loss" in e]
    return {"stdout": proc.stdout, "output": proc.stdout + proc.stderr, "logs": logs, "ranks": ranks}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, dict] = {}

    def get(command: str) -> dict:
        if command not in cache:  # a failed launch is remembered too, not relaunched per test
            try:
                cache[command] = run_command(command, tmp_path_factory.mktemp("grpo"))
            except AssertionError as error:
                cache[command] = error
        if isinstance(cache[command], AssertionError):
            raise cache[command]
        return cache[command]

    return get


# FSDP2's two commands in the default suite, FSDP1's with --slow (the same code per wrapper as FSDP2's).
COMMANDS = [pytest.param(c, marks=() if "fsdp2.yaml" in c else pytest.mark.slow) for c in QUICKSTART]
# The compatibility suite (-m compat, on every stack in stacks/): the first, with the plugin deferring.
COMMANDS[0] = pytest.param(QUICKSTART[0], marks=pytest.mark.compat)


@pytest.mark.parametrize("command", COMMANDS)
def test_quickstart_trains_with_real_fsdp_and_the_chosen_sync(runs, command):
    run = runs(command)
    fsdp = "fsdp1" if "fsdp1.yaml" in command else "fsdp2"
    defer = "--defer-grad-sync" in command
    assert len(run["ranks"]) == 2, "both ranks must report their collectives"
    units = None
    for rank in run["ranks"]:
        # Really FSDP-wrapped, by the wrapper the config names (never DDP, never unsharded).
        other = "fsdp1" if fsdp == "fsdp2" else "fsdp2"
        assert not rank[f"{other}_modules"] and not rank["ddp_modules"], rank
        layers = [m for m in rank[f"{fsdp}_modules"] if m.endswith("Qwen2DecoderLayer")]
        assert len(layers) == 2, rank  # each of the embedded model's 2 decoder layers is a unit
        units = rank[f"{fsdp}_reducing_groups"]
        assert units >= 3, rank  # the layers and the root's own parameters
        # Reduce-scatters match the mode: U per optimizer step deferred, M x U per micro-batch.
        counts = rank["counts"]
        reduce_scatters = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
        assert reduce_scatters == STEPS * units * (1 if defer else MICRO_BATCHES), rank


@pytest.mark.parametrize("command", COMMANDS)
def test_recipe_logs_agree_with_the_counted_collectives(runs, command):
    run = runs(command)
    fsdp = "fsdp1" if "fsdp1.yaml" in command else "fsdp2"
    defer = "--defer-grad-sync" in command
    units = run["ranks"][0][f"{fsdp}_reducing_groups"]
    # The recipe's own account agrees with what was counted outside it.
    # The few per-step counters a log carries by default, for the last step.
    last = run["logs"][-1]
    held = units if defer else 0
    assert last["grad_sync/reduce_scatters"] == units * (1 if defer else MICRO_BATCHES)
    assert last["grad_sync/reduce_scatters_skipped"] == held * (MICRO_BATCHES - 1)
    assert last["grad_sync/units_deferred"] == held and last["grad_sync/units_per_micro_batch"] == units - held
    assert (last["grad_sync/held_grad_bytes"] > 0) == defer
    assert len([k for k in last if k.startswith("grad_sync/")]) == 6  # not the ~20 counters of stats()


@pytest.mark.slow
def test_every_counter_is_logged_on_request(runs):
    run = runs(QUICKSTART[0] + " --grad-sync-log-all-counters")
    units = run["ranks"][0]["fsdp2_reducing_groups"]
    last = run["logs"][-1]
    assert last["grad_sync/units"] == units
    assert last["grad_sync/optimizer_steps"] == STEPS
    assert last["grad_sync/reduce_scatters_issued"] == STEPS * units
    assert last["grad_sync/deferred_micro_batches"] == STEPS * (MICRO_BATCHES - 1)


@pytest.mark.parametrize("config", ["fsdp2", pytest.param("fsdp1", marks=pytest.mark.slow)])
def test_deferring_does_not_change_the_first_step(runs, config):
    deferred, per_micro_batch = (runs(c) for c in QUICKSTART if f"/{config}.yaml" in c)
    first_d, first_p = deferred["logs"][0], per_micro_batch["logs"][0]
    assert first_d["step"] == first_p["step"] == 1
    # Same seed -> same generations, rewards and loss; the same gradient up to summation order.
    assert first_d["reward"] == first_p["reward"]
    assert first_d["loss"] == pytest.approx(first_p["loss"], rel=1e-5, abs=1e-7)
    assert first_d["grad_norm"] == pytest.approx(first_p["grad_norm"], rel=1e-4)


# The README's fastest GRPO command (tests/recipes/test_recipe_readme.py checks that).
WINDOWED = (
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync "
    "--grad-sync-keep-params-unsharded"
)


@pytest.mark.slow  # by default the README's fastest command runs with --beta (below); TRL's GRPO windowed
# against stock, step by step: tests/distributed/test_grpo_reference.py
def test_windowed_deferral_in_grpo_gathers_less_and_learns_the_same_first_step(runs):
    """Generation runs between windows (no-grad forwards); the window must survive it."""
    window, deferred, per_micro_batch = runs(WINDOWED), runs(QUICKSTART[0]), runs(QUICKSTART[1])
    assert "windowed" in window["stdout"]  # the decision line
    for w, d in zip(window["ranks"], deferred["ranks"], strict=True):
        gathers = [sum(r["counts"].get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor")) for r in (w, d)]
        units = w["fsdp2_reducing_groups"]
        # Training gathers each unit once per step instead of up to 2M times; generation gathers as before.
        assert gathers[0] <= gathers[1] - STEPS * units * (MICRO_BATCHES - 1), gathers
        counts = w["counts"]
        assert counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0) == STEPS * units
    first_w, first_p = window["logs"][0], per_micro_batch["logs"][0]
    assert first_w["reward"] == first_p["reward"]
    assert first_w["loss"] == pytest.approx(first_p["loss"], rel=1e-5, abs=1e-7)
    assert first_w["grad_norm"] == pytest.approx(first_p["grad_norm"], rel=1e-4)


# The fastest command with GRPO's KL term, as the README's estimate shows `--beta`: TRL builds the
# reference model from the policy's `name_or_path`, which the built-in model must make a real one.
BETA = WINDOWED + " --beta 0.04"


def test_the_default_model_trains_with_a_reference_model(runs):
    """The built-in model with `--beta 0.04` trains windowed (deferred with keep_params_unsharded);
    TRL's reference model is FSDP2-sharded beside the policy (one unit, trl.models.prepare_fsdp)
    and reduces no gradient; and it is the policy GRPO starts from, the warmed-up model: at step 1 (one iteration per
    generation, so the policy has not moved yet) the logged KL is rounding noise, where a random
    or un-warmed reference is far from it."""
    run = runs(BETA)
    assert "windowed" in run["stdout"]  # the decision line
    for rank in run["ranks"]:
        roots = [m for m in rank["fsdp2_modules"] if m.endswith("Qwen2ForCausalLM")]
        assert len(roots) == 2, rank  # the policy's root unit and the reference model, one unit
        layers = [m for m in rank["fsdp2_modules"] if m.endswith("Qwen2DecoderLayer")]
        assert len(layers) == 2, rank  # the policy's
        units = len(layers) + 1  # the policy's units: its layers and its root
        counts = rank["counts"]
        reduce_scatters = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
        assert reduce_scatters == STEPS * units, rank  # once per step, the policy's units only
    first, last = run["logs"][0], run["logs"][-1]
    assert first["step"] == 1 and abs(first["kl"]) < 1e-4, first
    assert last["step"] == STEPS and last["grad_norm"] > 0, last


# The real-model YAML's activation checkpointing (transformers' own): each decoder layer's training
# forward, FSDP2's hooks and the plugin's with it, runs again inside the backward.
CHECKPOINTED = " --activation_checkpointing true"


def _gathers(rank: dict) -> int:
    return sum(rank["counts"].get(n, 0) for n in ("all_gather_single", "all_gather_into_tensor"))


@pytest.mark.slow  # the default suite holds checkpointing through test_frozen_units' LoRA GRPO runs
def test_windowed_with_activation_checkpointing_learns_what_stock_learns_gathering_nothing_more(runs):
    window, stock = runs(BETA + CHECKPOINTED), runs(QUICKSTART[1] + " --beta 0.04" + CHECKPOINTED)
    for run in (window, stock):
        for rank in run["ranks"]:
            layers = rank["fsdp2_modules"].count("FSDPQwen2DecoderLayer")
            # Checkpointed, counted from outside: each layer's training forward in every micro-batch.
            assert rank["counts"].get("activation_checkpoint") == STEPS * MICRO_BATCHES * layers, rank["counts"]
    for mine, theirs in zip(window["logs"], stock["logs"], strict=True):
        assert mine["reward"] == theirs["reward"] and mine["step"] == theirs["step"]
        for key in ("loss", "kl", "grad_norm"):  # the same gradients, summed in another order
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (key, mine, theirs)
    # The recompute finds the window's units gathered: not one all-gather more than without it.
    assert [_gathers(r) for r in window["ranks"]] == [_gathers(r) for r in runs(BETA)["ranks"]]


def quoted_decision_lines(doc: str) -> list[str]:
    """Every line of `doc` (the README, a page of docs/) that starts as a printed line does: the
    lines of its fenced blocks (prose quotes one in backticks)."""
    return [line for line in (REPO / doc).read_text().splitlines() if line.startswith("grad sync:")]


@pytest.mark.parametrize("doc", ["README.md", "docs/recipe.md"])
def test_the_decision_lines_the_docs_quote_are_what_the_recipe_prints(runs, doc):
    """Each decision line README.md and docs/recipe.md quote is one the recipe's runs print (the
    default command's, the fastest command's), character for character."""
    # The fastest command's lines, from its run with --beta (the same plan, and the reference model's lines).
    printed = {line for command in (QUICKSTART[0], BETA) for line in runs(command)["stdout"].splitlines()}
    quoted = quoted_decision_lines(doc)
    assert quoted, doc
    for line in quoted:
        assert line in printed, (line, sorted(p for p in printed if p.startswith("grad sync:")))


AUTO = QUICKSTART[1] + " --grad-sync-mode auto"


@pytest.mark.slow  # auto's step 1 and plan: tests/distributed/test_auto.py
def test_auto_measures_step_one_per_micro_batch_then_follows_its_plan(runs):
    """Counted from outside, step 1 reduce-scatters every micro-batch; step 2 follows the
    plan auto printed after measuring (on this machine's RAM every unit fits: one per unit)."""
    run = runs(AUTO)
    assert "grad sync: auto measured step 1: peak" in run["stdout"]
    for rank in run["ranks"]:
        units = rank["fsdp2_reducing_groups"]
        counts = rank["counts"]
        reduce_scatters = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
        assert reduce_scatters == MICRO_BATCHES * units + (STEPS - 1) * units
    last = run["logs"][-1]
    assert last["grad_sync/units_windowed"] == units and last["grad_sync/plan_changes"] == 0
    assert last["grad_sync/measured_peak_bytes"] > 0  # auto's logs also carry what it measured


AUTO_FORECAST = AUTO + " --grad-sync-forecast-micro-batch-size 4 --grad-sync-forecast-seq-len 32"


@pytest.mark.slow  # the forecast's plan on real ranks: tests/distributed/test_forecast_auto.py
def test_auto_with_the_forecast_shape_runs_its_plan_from_step_one(runs):
    """Given the micro-batch shape, auto forecasts the step at bind: counted from outside, step 1
    already reduce-scatters once per unit (no measuring step), and the logs carry the forecast."""
    run = runs(AUTO_FORECAST)
    assert "auto planned step 1 from the forecast: peak" in run["stdout"]
    for rank in run["ranks"]:
        units = rank["fsdp2_reducing_groups"]
        counts = rank["counts"]
        assert counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0) == STEPS * units
    last = run["logs"][-1]
    assert last["grad_sync/units_windowed"] == units and last["grad_sync/plan_changes"] == 0
    assert last["grad_sync/forecast_peak_bytes"] > 0


def fifth_means(logs: list[dict], key: str) -> tuple[float, float]:
    fifth = max(1, len(logs) // 5)
    return sum(e[key] for e in logs[:fifth]) / fifth, sum(e[key] for e in logs[-fifth:]) / fifth


@pytest.mark.slow  # a whole default run: about 2 minutes on 2 idle cores, 4 on a loaded machine
@pytest.mark.parametrize("seed", [None, 1, 2])  # None: the recipe's default seed, i.e. the README's command
def test_the_default_run_learns(tmp_path, seed):
    """The README's first command, all defaults, learns the task: the accuracy reward rises, the
    groups keep disagreeing (a policy collapsed onto one printed number has frac_reward_zero_std
    1 and grad_norm 0), over the default seed and two others."""
    argv = shlex.split(QUICKSTART[0])[2:] + ["--disable_tqdm", "true", "--output_dir", str(tmp_path / "out")]
    argv += [] if seed is None else ["--seed", str(seed)]
    cmd, env = recipe_launch(argv)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    logs = [
        e for e in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"] if "reward" in e
    ]
    assert len(logs) >= 40  # every 10 steps of 500
    first, last = fifth_means(logs, "rewards/accuracy_reward/mean")
    assert first < 0.45 and last > first + 0.1, (first, last)  # right answers: clearly more at the end
    zero_std = [e["frac_reward_zero_std"] for e in logs]
    assert max(zero_std) <= 0.6 and sum(zero_std) / len(zero_std) < 0.3, zero_std  # groups keep disagreeing
    assert min(e["grad_norm"] for e in logs) > 0
