"""The torch release series this package is tested on, and one warning at attach on another.

The tested series are those `compat/fsdp2.py` tables FSDP2's private attributes for; CI runs the
suite on each (constraints.txt, stacks/*.txt) and setup.cfg allows exactly them
(tests/repo/test_ci.py keeps the three in agreement). Two checks guard a torch of another
series: this module warns once at `attach`, where every attribute may still be there but
nothing here has run on it, and `runtime/fsdp.check_fsdp2_internals` raises at bind, naming
what is missing.
"""

from __future__ import annotations

import warnings

import torch

from accel_gradsync.compat.fsdp2 import tabled_series, torch_series
from accel_gradsync.config.errors import GradSyncWarning

TESTED_TORCH: tuple[str, ...] = tuple(tabled_series())
"""The torch release series (major.minor) CI runs the suite on, oldest first."""

_warned: set[str] = set()


def is_tested_torch(version: str) -> bool:
    """True when `version` (a `torch.__version__`) is of a tested series. Patch releases and
    build labels (`2.13.1`, `2.14.0+cu130`, `2.13.0a0+git...`) count: torch changes FSDP2's
    private fields between minor releases, not within one."""
    return torch_series(version) in TESTED_TORCH


def describe_tested_torch() -> str:
    """The tested series as messages name them: `torch 2.13 or 2.14`."""
    *older, newest = TESTED_TORCH
    return "torch " + (f"{', '.join(older)} or {newest}" if older else newest)


def warn_if_untested_torch(version: str = torch.__version__) -> None:
    """One `GradSyncWarning` per process (and version) when torch is not of a tested series."""
    if version in _warned or is_tested_torch(version):
        return
    _warned.add(version)
    warnings.warn(
        f"accel_gradsync: torch {version} is not a release it was tested on ({describe_tested_torch()}; "
        "accel_gradsync/compat/fsdp2.py has no entry for it). It reads FSDP2 private attributes that change "
        "between releases: attach() stops with their names if one is missing, and otherwise runs untested. "
        f"Install torch=={TESTED_TORCH[-1]}.0 (or another tested release) to run what CI runs.",
        GradSyncWarning,
        stacklevel=3,
    )
