"""The README as a newcomer meets it: at most 300 lines, its first screen says what the package is,
gives the two commands and says where to go next, and its estimate examples run as written,
offline, printing the counts the plan implies (the TRL script and the plain loop are launched by
tests/distributed/test_readme_scripts.py)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = 40  # lines


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def bash_commands(title: str) -> list[str]:
    """Each command of the section's bash blocks, backslash continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", section(title), re.S)
    return [c.strip() for block in blocks for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_readme_fits_its_budget():
    assert len(README.splitlines()) <= 300


def test_the_first_screen_says_what_it_is_the_two_commands_and_where_next():
    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    assert "Accelerate" in screen and "plugin" in screen  # what it is
    assert "```bash\nmake demo\nmake test\n```" in screen
    assert "(#what-next)" in screen and "\n## What next\n" in README


def test_what_next_says_where_the_output_is_how_to_see_it_learned_and_the_device_launch():
    what_next = section("What next")
    assert "`runs/grpo`" in what_next
    assert "recipes/plot_rewards.py runs/grpo/trainer_state.json" in what_next.replace("\n  ", " ")
    commands = bash_commands("What next")
    assert any("--num_processes" in c and "fsdp2.yaml" in c for c in commands)
    assert any("ASCEND_RT_VISIBLE_DEVICES" in c and "_npu.yaml" in c for c in commands)
    for command in commands:  # every config named exists
        for path in re.findall(r"accelerate_configs/\S+", command):
            assert (ROOT / path).is_file(), path


def run_as_written(command: str) -> subprocess.CompletedProcess:
    """`command` through bash, with this interpreter's scripts first on PATH (`accel-gradsync`)
    and the hub off: what a user without network access gets."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def rows(output: str) -> dict[str, list[str]]:
    """The estimate's table: each mode's row, by the mode's name, its columns split on 2+ spaces."""
    lines = output.split("\n\n", 1)[1].splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    assert header[:3] == ["mode", "reduce-scatters/step", "all-reduces/step"], header
    table = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        table[cells[0].removesuffix(" *")] = cells[1:]
    return table


# The recipe's built-in model (recipes/embedded.py): 2 decoder layers, each one FSDP unit, and the
# root: U = 3 units; 75,392 parameters (the header says so; `estimate --json` lists them by unit).
UNITS, PARAMS = 3, 75_392


def test_the_offline_estimate_example_leads_and_runs_as_written():
    """The first example needs no network; per-micro-batch sync reduce-scatters and (HSDP)
    all-reduces each unit once per micro-batch, deferral once per step, holding every unsharded
    gradient in the fp32 reduce dtype."""
    first, *_ = bash_commands("Estimate before launch")
    assert "--model recipe-default" in first and "accelerate_configs/hsdp.yaml" in first
    proc = run_as_written(first)
    assert proc.returncode == 0, proc.stderr
    m = int(re.search(r"--micro-batches (\d+)", first).group(1))
    assert f"{PARAMS:,} trainable params in {UNITS} fsdp2 units" in proc.stdout
    table = rows(proc.stdout)
    assert table["per_micro_batch"][:2] == [str(m * UNITS)] * 2
    assert table["deferred"][:2] == [str(UNITS)] * 2
    held = table["deferred"][3:5]  # 4 bytes per fp32 gradient, 2 in the bf16 compute dtype
    assert held == [f"{PARAMS * 4 / 1024:.1f} KiB (bf16: {PARAMS * 2 / 1024:.1f} KiB)", "fp32"], held
    hub = section("Estimate before launch").index("--model Qwen/Qwen2-7B")
    assert section("Estimate before launch").index(first.split()[0]) < hub  # the hub model comes after


def test_the_step_peak_example_runs_as_written():
    """The forecast example: the same counts for its M, and a step peak in every applicable row."""
    _, peak = bash_commands("Estimate before launch")
    proc = run_as_written(peak)
    assert proc.returncode == 0, proc.stderr
    m = int(re.search(r"--micro-batches (\d+)", peak).group(1))
    table = rows(proc.stdout)
    assert table["per_micro_batch"][0] == str(m * UNITS) and table["deferred"][0] == str(UNITS)
    assert "step peak/rank" in proc.stdout and "grad sync: reference model ref_model" in proc.stdout
    for mode in ("per_micro_batch", "deferred", "deferred+windowed"):
        assert re.search(r"\d MiB \(\w+\)", " ".join(table[mode])), table[mode]


def test_the_output_folder_named_is_the_recipes_default():
    """`runs/grpo`, where What next and `make demo` look, is recipes/grpo.py's `output_dir` default
    (read from its source: the recipe needs TRL, which this layer's tests do not import)."""
    tree = ast.parse((ROOT / "recipes" / "grpo.py").read_text())
    (defaults,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RECIPE_DEFAULTS" for t in node.targets)
    ]
    assert isinstance(defaults, ast.Call)
    (output_dir,) = [ast.literal_eval(k.value) for k in defaults.keywords if k.arg == "output_dir"]
    assert output_dir == "runs/grpo"
