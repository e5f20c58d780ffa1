"""tools/mutants.py's registry still fits the code: each mutant's text occurs exactly once in its
file and each of its tests exists, so `make mutants` breaks what it says it breaks (the mutants
themselves run before a release, not here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutants", REPO / "tools" / "mutants.py")
assert spec is not None and spec.loader is not None
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_the_mutant_still_applies(name):
    assert mutants.stale(name) == []


def test_a_mutant_that_no_longer_matches_is_reported(monkeypatch):
    file, old, new = mutants.MUTANTS["generation_per_token_plus_one"]["edits"][0]
    monkeypatch.setitem(
        mutants.MUTANTS, "moved", {"what": "", "edits": [(file, old + "# moved", new)], "tests": ["tests/none.py"]}
    )
    problems = mutants.stale("moved")
    assert len(problems) == 2 and "occurs 0 times" in problems[0] and problems[1] == "no test tests/none.py"
