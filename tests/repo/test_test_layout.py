"""The test tree's own rules: pytest imports each test module by its basename (rootdir-relative,
no packages), so two test files of one name in different folders stop the whole run at
collection ("import file mismatch")."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
