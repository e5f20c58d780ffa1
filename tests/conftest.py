"""`@pytest.mark.slow` tests and params are skipped unless `--slow` or `-m slow`: the default suite
keeps one short case of each multi-rank scenario (12 to 30 minutes on 2 CPU cores, torch 2.13: 18.2
in CI's run of 0926a04 on 2026-12-06, whose whole `.ci/run` took 32 minutes; 29.6 in the one
before the longest second cases went to --slow), and a module
fixture that launches many runs at once asks the `slow` fixture whether to launch them all or a
short share (and under `-m compat` alone, the `compat_only` fixture, only what the compat tests read).

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


def runs_slow(config) -> bool:
    markexpr = config.getoption("-m") or ""
    return bool(config.getoption("--slow") or ("slow" in markexpr and "not slow" not in markexpr))


@pytest.fixture(scope="session")
def compat_only(request) -> bool:
    """True under `-m compat` alone (each stack's suite, `make test-compat`): a module fixture then
    launches only the runs its compat tests read, the others being deselected."""
    return (request.config.getoption("-m") or "").strip() == "compat"


@pytest.fixture(scope="session")
def slow(request) -> bool:
    """True under `--slow`: a module fixture then launches its full set of runs, else a short one."""
    return runs_slow(request.config)


def pytest_collection_modifyitems(config, items):
    if runs_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
