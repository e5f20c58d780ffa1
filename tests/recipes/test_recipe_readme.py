"""The README's GRPO quick-start commands are exactly the ones the end-to-end test launches, and
every file the section's commands name exists."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TITLE_COMMAND = "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync"


def grpo_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## GRPO recipe\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def fenced_commands(section: str) -> list[list[str]]:
    """Each fenced bash block as its commands (backslash continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [[c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()] for block in blocks]


def e2e_constant(name: str):
    """A constant of the e2e test, read without importing it (it needs the launcher's path)."""
    tree = ast.parse((REPO / "tests/distributed/test_grpo_recipe.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"tests/distributed/test_grpo_recipe.py defines no {name}")


def e2e_quickstart() -> list[str]:
    return e2e_constant("QUICKSTART")


def test_quickstart_is_what_the_e2e_test_runs():
    quickstart = fenced_commands(grpo_section())[0]
    assert quickstart == e2e_quickstart()
    assert quickstart[0] == TITLE_COMMAND  # the command `make demo` runs, first


def test_the_fastest_command_is_what_the_e2e_test_runs():
    assert fenced_commands(grpo_section())[1] == [e2e_constant("WINDOWED")]


def test_e2e_covers_both_fsdp_versions_and_both_modes():
    runs = {(re.search(r"(fsdp\d)\.yaml", c).group(1), "--defer-grad-sync" in c) for c in e2e_quickstart()}
    assert runs == {(v, d) for v in ("fsdp1", "fsdp2") for d in (True, False)}


def test_files_named_by_the_section_exist():
    section = grpo_section()
    for block in fenced_commands(section):
        for command in block:
            for arg in shlex.split(command):
                if re.fullmatch(r"(recipes|accelerate_configs)/\S+", arg):
                    assert (REPO / arg).is_file(), arg
    for path in re.findall(r"\((docs/[\w./-]+)\)", section) + re.findall(
        r"`((?:recipes|accelerate_configs|docs)/[\w./-]+)`", section
    ):
        assert (REPO / path).is_file(), path
