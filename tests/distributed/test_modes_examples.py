"""docs/modes.md's worked loops, launched as the doc says a user launches them: each is an example
file whose loop the doc quotes line for line, run by `accelerate launch` with
accelerate_configs/fsdp2.yaml on 2 CPU processes (real FSDP2 over gloo), its collectives counted
from outside the script (recipe_counter/sitecustomize.py).
"""

from __future__ import annotations

import ast
import re

from launcher import REPO, all_gathers, launch_counted, reduce_scatters

MODES = (REPO / "docs" / "modes.md").read_text()
TOKEN_BUDGET = REPO / "examples" / "token_budget.py"
UNITS = 3  # the example's tiny Qwen2: 2 Qwen2DecoderLayer units (fsdp2.yaml's wrap class) and the root


def constant(name: str) -> object:
    """A module-level constant of examples/token_budget.py, read from its text."""
    for node in ast.parse(TOKEN_BUDGET.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [target.id for target in node.targets[0].elts]
            if name in names:
                return ast.literal_eval(node.value)[names.index(name)]
    raise KeyError(name)


def section(title: str) -> str:
    return MODES.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def step_n_section() -> str:
    return section("Per-rank micro-batch counts every step")


def test_the_step_n_worked_loop_is_the_example_files():
    """Every line of the doc's loop is in examples/token_budget.py, in the same order."""
    (block,) = re.findall(r"```python\n(.*?)```", step_n_section(), re.S)
    snippet = [line for line in block.splitlines() if line.strip()]
    lines = iter(TOKEN_BUDGET.read_text().splitlines())
    missing = [line for line in snippet if not any(line == candidate for candidate in lines)]
    assert missing == [], missing


def test_the_step_n_example_runs_its_own_count_on_each_rank_with_the_same_collectives(tmp_path):
    """The example as the doc launches it: every step packs each rank's rollouts into its own count
    of micro-batches, and under deferral with every unit windowed every rank issues the same
    collectives whatever its counts: one reduce-scatter per unit and step, the same all-gathers,
    no micro-batch replayed, and the counters say which micro-batches the window made free."""
    (command,) = re.findall(r"`(accelerate launch [^`]*examples/token_budget\.py)`", step_n_section())
    run = launch_counted(command, tmp_path)
    steps = constant("STEPS")
    counts: dict[int, list[tuple[int, int, int]]] = {0: [], 1: []}  # rank -> per step (n, smallest, largest)
    totals: dict[int, dict] = {}
    lines = re.findall(r"^rank (\d): (\d+) of (\d+)-(\d+) micro-batches$", run["stdout"], re.M)
    for rank, n, smallest, largest in lines:
        counts[int(rank)].append((int(n), int(smallest), int(largest)))
    for rank, stats in re.findall(r"^rank (\d): (\{.*\})$", run["stdout"], re.M):
        totals[int(rank)] = ast.literal_eval(stats)
    assert [len(c) for c in counts.values()] == [steps, steps], run["stdout"][-3000:]
    per_step = list(zip(counts[0], counts[1], strict=True))
    for (n0, lo, hi), (n1, *agreed) in per_step:
        assert [lo, hi] == agreed == [min(n0, n1), max(n0, n1)], per_step
    assert any(n0 != n1 for (n0, *_), (n1, *_) in per_step), f"no step with uneven counts: {per_step}"
    for rank in (0, 1):
        own = [n for n, _, _ in counts[rank]]
        assert totals[rank]["micro_batches"] == sum(own), totals[rank]
        assert totals[rank]["replayed_micro_batches"] == 0, totals[rank]
        assert totals[rank]["evened_micro_batches"] == sum(hi - n for n, _, hi in counts[rank]), totals[rank]
    first, second = run["ranks"]
    for rank in run["ranks"]:
        assert rank["fsdp2_reducing_groups"] == UNITS and rank["ddp_modules"] == 0, rank
        assert reduce_scatters(rank) == steps * UNITS, rank["counts"]
    # Generation gathers each unit once (`gathered`), training at most once more per step, on both
    # ranks alike: never per micro-batch, whichever rank ran more of them.
    assert all_gathers(first) == all_gathers(second) <= steps * 2 * UNITS, (first["counts"], second["counts"])
