"""The README's two scripts, launched as a user launches them: `accelerate launch` with
accelerate_configs/fsdp2.yaml on 2 CPU processes, which `enable_cpu_fsdp()` makes real FSDP2 over
gloo. The plain loop is examples/plain_loop.py (the README's snippet is its text, line for line);
the TRL script is the README's block itself, written to a file as it stands and given a saved
tiny Qwen2 (tests/distributed/recipe_inputs.py) as `<model>`. What ran is counted from outside the
script (recipe_counter/sitecustomize.py) and held against what the plan implies: with deferral,
each FSDP unit reduce-scatters once per optimizer step instead of once per micro-batch.
"""

from __future__ import annotations

import json
import re

import recipe_inputs
from launcher import REPO, launch_counted, reduce_scatters

README = (REPO / "README.md").read_text()
EXAMPLE = REPO / "examples" / "plain_loop.py"
# Both models: 2 Qwen2DecoderLayer units (fsdp2.yaml's wrap class) and the root, embeddings tied.
UNITS = 3


def using_the_plugin() -> str:
    return README.split("\n## Using the plugin\n", 1)[1].split("\n## ", 1)[0]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", using_the_plugin(), re.S)


def assert_real_fsdp2(rank: dict) -> None:
    assert rank["fsdp2_reducing_groups"] == UNITS and rank["ddp_modules"] == 0, rank
    assert rank["fsdp2_modules"].count("FSDPQwen2DecoderLayer") == 2, rank["fsdp2_modules"]


def test_the_readme_plain_loop_is_the_example_file():
    """Every line of the README's loop is in examples/plain_loop.py, in the same order (the file
    adds the tiny model, its optimizer and loader around them)."""
    snippet = [line for line in python_blocks()[0].splitlines() if line.strip()]
    lines = iter(EXAMPLE.read_text().splitlines())
    missing = [line for line in snippet if not any(line == candidate for candidate in lines)]
    assert missing == [], missing


def test_the_plain_loop_example_trains_with_one_reduce_scatter_per_unit_and_step(tmp_path):
    (command,) = re.findall(r"`(accelerate launch [^`]*examples/plain_loop\.py)`", using_the_plugin())
    run = launch_counted(command, tmp_path)
    # The example: 32 sequences, 2 per micro-batch on each of 2 ranks, so 8 micro-batches per
    # rank; M = 4 per optimizer step, so 2 steps. Deferred: each unit reduce-scatters at the last
    # micro-batch of a step only.
    m, steps = 4, 32 // (2 * 2) // 4
    for rank in run["ranks"]:
        assert_real_fsdp2(rank)
        assert reduce_scatters(rank) == steps * UNITS, rank["counts"]
    expected = {
        "micro_batches": steps * m,
        "deferred_micro_batches": steps * (m - 1),
        "reduce_scatters_issued": steps * UNITS,
        "reduce_scatters_skipped": steps * (m - 1) * UNITS,
    }
    assert run["stdout"].count(repr(expected)) == 1, run["stdout"][-3000:]  # the main process prints it
    decision = f"grad sync: deferred over {m} micro-batches on fsdp2 ({UNITS} deferred) -> {UNITS} reduce-scatters"
    assert decision in run["stdout"]


def test_the_readme_trl_script_runs_as_written_on_cpu(tmp_path):
    """The README's TRL script, unchanged, under the README's command: `<model>` a saved tiny Qwen2,
    and a short run's sizes appended (2 optimizer steps of M = 2 micro-batches, 8-token
    completions). On this CPU-only machine it runs as FSDP2 without `--bf16 false` (TRL's bf16
    default is refused here) and without pinned-memory warnings: `training_args_defaults()`."""
    script = tmp_path / "my_grpo.py"
    script.write_text(python_blocks()[1])
    (command,) = [c for c in re.findall(r"```bash\n(.*?)```", using_the_plugin(), re.S) if "my_grpo.py" in c]
    model = recipe_inputs.save_model(tmp_path / "model")
    out = tmp_path / "out"
    m, steps = 2, 2
    short = (
        f" --output_dir {out} --max_steps {steps} --gradient_accumulation_steps {m} --per_device_train_batch_size 4"
        f" --num_generations 4 --max_completion_length 8 --logging_steps 1 --save_steps {steps} --report_to none"
    )
    command = command.strip().replace("my_grpo.py", str(script)).replace("<model>", str(model)) + short
    assert "--defer-grad-sync" in command
    run = launch_counted(command, tmp_path)
    for refused in ("doesn't support bf16", "pin_memory"):  # transformers' error, torch's DataLoader warning
        assert refused not in run["output"], run["output"][-3000:]
    for rank in run["ranks"]:
        assert_real_fsdp2(rank)
        assert reduce_scatters(rank) == steps * UNITS, rank["counts"]
    assert f"grad sync: deferred over {m} micro-batches on fsdp2 ({UNITS} deferred)" in run["stdout"]
    state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in logs] == list(range(1, steps + 1))
    assert all(e["grad_sync/reduce_scatters"] == UNITS for e in logs), logs
    assert all(e["grad_sync/reduce_scatters_skipped"] == (m - 1) * UNITS for e in logs), logs
