"""The registry of `stats()` keys (stats_keys.py): each key names a test that exists and reads
that key. That every key a real run reports is registered is checked where the runs are
(test_accumulate.py, test_modes.py)."""

import ast
import functools
from pathlib import Path

import pytest
from stats_keys import REGISTRY, unregistered

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _tests_of(path: str) -> dict[str, str]:
    """Each test function of tests/distributed/`path` and its source."""
    text = (REPO / "tests" / "distributed" / path).read_text()
    return {
        f.name: ast.get_source_segment(text, f) or "" for f in ast.parse(text).body if isinstance(f, ast.FunctionDef)
    }


def _test_source(node: str) -> str:
    path, name = node.split("::")
    tests = _tests_of(path)
    assert name in tests, f"{node}: no such test"
    return tests[name]


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_registered_key_names_a_test_that_reads_it(key):
    source = _test_source(REGISTRY[key])
    assert f'"{key}"' in source, f"{REGISTRY[key]} does not read stats()[{key!r}]"


def test_a_new_key_is_reported_until_it_is_registered():
    assert unregistered({"mode": "deferred", "models": {"m": {"a_new_counter": 1}}}) == ["a_new_counter"]
    assert unregistered({k: {} if k == "models" else 0 for k in REGISTRY}) == []
