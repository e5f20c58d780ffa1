"""docs/modes.md's worked loops, launched as the doc says a user launches them: each is an example
file whose loop the doc quotes line for line, run by `accelerate launch` with
accelerate_configs/fsdp2.yaml on 2 CPU processes (real FSDP2 over gloo), its collectives counted
from outside the script (recipe_counter/sitecustomize.py).
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

from launcher import REPO, all_gathers, launch_counted, reduce_scatters

# Both ranks print to one pipe: a line's newline may land after the other rank's next line (Python
# writes a print's text and its end apart), so what each rank printed is matched without anchors.

MODES = (REPO / "docs" / "modes.md").read_text()
TOKEN_BUDGET = REPO / "examples" / "token_budget.py"
UNEVEN_INPUTS = REPO / "examples" / "uneven_inputs.py"
UNITS = 3  # the example's tiny Qwen2: 2 Qwen2DecoderLayer units (fsdp2.yaml's wrap class) and the root


def constant(example: Path, name: str) -> Any:
    """A module-level constant of `example`, read from its text."""
    for node in ast.parse(example.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [target.id for target in node.targets[0].elts]
            if name in names:
                return ast.literal_eval(node.value)[names.index(name)]
    raise KeyError(name)


def section(title: str) -> str:
    return MODES.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def step_n_section() -> str:
    return section("Per-rank micro-batch counts every step")


def missing_lines(block: str, example: Path) -> list[str]:
    """The lines of a doc's `block` that `example` lacks, or has in another order."""
    snippet = [line for line in block.splitlines() if line.strip()]
    lines = iter(example.read_text().splitlines())
    return [line for line in snippet if not any(line == candidate for candidate in lines)]


def test_the_step_n_worked_loop_is_the_example_files():
    """Every line of the doc's loop is in examples/token_budget.py, in the same order."""
    (block,) = re.findall(r"```python\n(.*?)```", step_n_section(), re.S)
    assert missing_lines(block, TOKEN_BUDGET) == []


def test_the_join_loop_is_the_example_files():
    """Every line of the doc's `join()` loop is in examples/uneven_inputs.py, in the same order."""
    block = re.findall(r"```python\n(.*?)```", section("Uneven inputs: `join()`"), re.S)[0]
    assert missing_lines(block, UNEVEN_INPUTS) == []


def test_the_join_example_pairs_every_collective_of_a_rank_with_one_batch_more(tmp_path):
    """The example as the doc launches it: without accelerate's even batches, its 30 sequences of 2
    per micro-batch give rank 0 one micro-batch more than rank 1; inside `join()` rank 1 shadows
    it, so both ranks issue the same all-gathers, and deferral's one reduce-scatter per unit and
    optimizer step, the steps the longer rank's count makes."""
    (command,) = re.findall(
        r"`(accelerate launch [^`]*examples/uneven_inputs\.py)`", section("Uneven inputs: `join()`")
    )
    run = launch_counted(command, tmp_path)
    sequences, batch_size, m = (
        constant(UNEVEN_INPUTS, name) for name in ("SEQUENCES", "BATCH_SIZE", "ACCUMULATION_STEPS")
    )
    batches = math.ceil(sequences / batch_size)
    longer, shorter = math.ceil(batches / 2), batches // 2
    assert longer == shorter + 1, (longer, shorter)
    printed = dict(re.findall(r"rank (\d): (\d+) batches, ", run["stdout"]))
    assert printed == {"0": str(longer), "1": str(shorter)}, run["stdout"][-3000:]
    steps = longer // m
    first, second = run["ranks"]
    for rank in run["ranks"]:
        assert rank["fsdp2_reducing_groups"] == UNITS and rank["ddp_modules"] == 0, rank
        assert reduce_scatters(rank) == steps * UNITS, rank["counts"]
    assert all_gathers(first) == all_gathers(second) > 0, (first["counts"], second["counts"])


def test_the_step_n_example_runs_its_own_count_on_each_rank_with_the_same_collectives(tmp_path):
    """The example as the doc launches it: every step packs each rank's rollouts into its own count
    of micro-batches, and under deferral with every unit windowed every rank issues the same
    collectives whatever its counts: one reduce-scatter per unit and step, the same all-gathers,
    no micro-batch replayed, and the counters say which micro-batches the window made free."""
    (command,) = re.findall(r"`(accelerate launch [^`]*examples/token_budget\.py)`", step_n_section())
    run = launch_counted(command, tmp_path)
    steps = constant(TOKEN_BUDGET, "STEPS")
    counts: dict[int, list[tuple[int, int, int]]] = {0: [], 1: []}  # rank -> per step (n, smallest, largest)
    totals: dict[int, dict] = {}
    lines = re.findall(r"rank (\d): (\d+) of (\d+)-(\d+) micro-batches", run["stdout"])
    for rank, n, smallest, largest in lines:
        counts[int(rank)].append((int(n), int(smallest), int(largest)))
    for rank, stats in re.findall(r"rank (\d): (\{[^{}]*\})", run["stdout"]):
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
