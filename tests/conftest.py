"""`@pytest.mark.slow` tests (soak, long property runs) are skipped unless `--slow` or `-m slow`.

The package alone (`pip install accel-gradsync`, no extras) runs the tests of the package itself:
the recipe's tests and the multi-rank suite (which trains the recipe's models with TRL and PEFT)
need the `recipes` extra, the benchmark tests the `bench` extra, and are not collected without.
"""

import importlib.util

import pytest


def _missing(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is None for m in modules)


collect_ignore = []
if _missing("trl", "datasets", "peft", "tokenizers"):
    collect_ignore += [
        "distributed",
        "recipes",
        "unit/config/test_settings.py",
    ]
if _missing("matplotlib"):
    collect_ignore += ["benchmarks/test_mlp_report.py", "benchmarks/test_mlp_smoke.py"]


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    if config.getoption("--slow") or ("slow" in markexpr and "not slow" not in markexpr):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
