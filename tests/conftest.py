"""`@pytest.mark.slow` tests (soak, long property runs) are skipped unless `--slow` or `-m slow`."""

import pytest


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
