"""recipes/grpo.py on a model directory and a local dataset, launched as users do: `accelerate
launch` on 2 CPU processes, FSDP2 and FSDP1, a `save_to_disk` folder and a JSON file, and the
real-model recipe YAML with its paths and sizes overridden on the command line.

The model is a tiny Qwen2 saved with `save_pretrained` (tests/distributed/recipe_inputs.py); the
dataset is GSM8K-shaped (`question`, `answer` ending in `#### <n>`). What the recipe logs is held
against what `recipe_counter/sitecustomize.py` counts from outside the script.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import recipe_inputs
from launcher import REPO, recipe_launch

COUNTER = Path(__file__).parent / "recipe_counter"
STEPS = 2
MICRO_BATCHES = 4  # the recipe's default gradient_accumulation_steps, and the YAML's
SHORT = f"--max_steps {STEPS} --max_completion_length 8 --logging_steps 1 --disable_tqdm true"

# The command lines, as a user types them; {model}, {folder}, {json} are the saved inputs.
FSDP2_FOLDER = (
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --model_name_or_path {model} "
    f"--dataset_name {{folder}} --prompt_column question --save_steps 1 {SHORT}"
)
FSDP1_JSON = (
    "accelerate launch --config_file accelerate_configs/fsdp1.yaml recipes/grpo.py --model_name_or_path {model} "
    f"--dataset_name {{json}} --prompt_column question --defer-grad-sync --grad-sync-keep-params-unsharded {SHORT}"
)
# The YAML's model, dataset and sizes are for a GPU; everything else comes from the YAML.
YAML = (
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py "
    "--config recipes/qwen2.5-0.5b-gsm8k.yaml --model_name_or_path {model} --dataset_name {folder} "
    f"--bf16 false --report_to none {SHORT}"
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("inputs")
    return {
        "model": recipe_inputs.save_model(tmp / "model"),
        "folder": recipe_inputs.save_dataset_folder(tmp / "gsm8k"),
        "json": recipe_inputs.save_dataset_json(tmp / "gsm8k.json"),
    }


def launch(command: str, inputs: dict, out_dir: Path) -> dict:
    """Run one command line from the repo root with the collectives counted from outside."""
    argv = shlex.split(command.format(**inputs))
    assert argv[:2] == ["accelerate", "launch"], command
    counter_dir = out_dir.parent / "counters"
    counter_dir.mkdir(parents=True)
    env = {
        "RECIPE_COUNTER_DIR": str(counter_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")])),
    }
    cmd, env = recipe_launch([*argv[2:], "--output_dir", str(out_dir)], env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{command} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    state = json.loads((out_dir / "trainer_state.json").read_text())
    return {
        "output": proc.stdout + proc.stderr,
        "steps": [e for e in state["log_history"] if "loss" in e],
        "ranks": [json.loads(p.read_text()) for p in sorted(counter_dir.glob("rank*.json"))],
        "out_dir": out_dir,
    }


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    cache: dict[str, dict | AssertionError] = {}

    def get(command: str) -> dict:
        if command not in cache:  # a failed launch is remembered too, not relaunched per test
            try:
                cache[command] = launch(command, inputs, tmp_path_factory.mktemp("run") / "output")
            except AssertionError as error:
                cache[command] = error
        result = cache[command]
        if isinstance(result, AssertionError):
            raise result
        return result

    return get


def reduce_scatters(rank: dict) -> int:
    return rank["counts"].get("reduce_scatter_single", 0) + rank["counts"].get("reduce_scatter_tensor", 0)


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(FSDP2_FOLDER, id="fsdp2-folder", marks=pytest.mark.slow),
        pytest.param(FSDP1_JSON, id="fsdp1-json", marks=pytest.mark.slow),
        pytest.param(YAML, id="yaml", marks=pytest.mark.slow),
    ],
)
def test_a_model_directory_and_a_local_dataset_train_with_real_fsdp(runs, command):
    run = runs(command)
    fsdp = "fsdp1" if "fsdp1.yaml" in command else "fsdp2"
    defer = "--defer-grad-sync" in command or command is YAML  # the YAML sets `defer: true`
    assert len(run["steps"]) == STEPS
    assert len(run["ranks"]) == 2, "both ranks must report their collectives"
    for rank in run["ranks"]:
        layers = [m for m in rank[f"{fsdp}_modules"] if m.endswith("Qwen2DecoderLayer")]
        assert len(layers) == recipe_inputs.DECODER_LAYERS and not rank["ddp_modules"], rank
        units = rank[f"{fsdp}_reducing_groups"]
        # Counted outside the script: U per step deferred, M x U per micro-batch ...
        assert reduce_scatters(rank) == STEPS * units * (1 if defer else MICRO_BATCHES), rank
        # ... and the plugin's own per-step counters, as the Trainer logged them, agree.
        assert sum(step["grad_sync/reduce_scatters"] for step in run["steps"]) == reduce_scatters(rank)
        assert all(step["grad_sync/units_deferred"] == (units if defer else 0) for step in run["steps"])
    # The accuracy reward read the GSM8K answers (its key is logged; the value is a share of right answers).
    assert all(0 <= step["rewards/accuracy_reward/mean"] <= 1 for step in run["steps"])
    # FSDP2 saves ordinary weights; FSDP1 on CPU saves a sharded state dict only (README, CPU notes).
    assert (run["out_dir"] / "model.safetensors").is_file() == (fsdp == "fsdp2")


@pytest.mark.slow
def test_save_steps_alone_saves_every_n_steps(runs):
    """--save_steps 1 without --save_strategy: a whole checkpoint after each step."""
    out_dir = runs(FSDP2_FOLDER)["out_dir"]
    for step in range(1, STEPS + 1):
        folder = out_dir / f"checkpoint-{step}"
        assert (folder / "trainer_state.json").is_file() and (folder / "model.safetensors").is_file(), step
        assert json.loads((folder / "checkpoint_complete.json").read_text()) == {"global_step": step, "world_size": 2}


@pytest.mark.slow
def test_the_yaml_keys_reach_the_run(runs, inputs):
    """Every YAML key the command line does not override is what the run used."""
    import torch

    run = runs(YAML)
    args = torch.load(run["out_dir"] / "training_args.bin", weights_only=False)
    assert (args.lr_scheduler_type.value, args.warmup_steps, args.learning_rate) == ("cosine", 10, 1e-6)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations) == (8, 4, 8)
    assert (args.save_strategy.value, args.save_steps) == ("steps", 100)
    assert args.model_init_kwargs["dtype"] == "bfloat16"
    # GSM8K's `dataset_config: main` has no meaning for a local folder: said once, not dropped silently.
    assert run["output"].count("--dataset_config main is ignored") == 1


@pytest.mark.slow
def test_keep_params_unsharded_on_fsdp1_only_warns(runs):
    run = runs(FSDP1_JSON)
    assert "keep_params_unsharded does not apply on fsdp1" in run["output"]
