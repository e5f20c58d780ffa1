"""The torch release this package is tested on, and one warning at attach when another runs it.

FSDP2 has setters but no getters for the per-unit state the adapters read, so `fsdp.py` reads
private attributes whose names change between torch releases. Two checks guard that:
`fsdp.check_fsdp2_internals` raises at bind, naming what is missing; this module warns once at
`attach` when torch is of another release series, where every attribute may still be there
but nothing here has run on it. constraints.txt pins the tested release and setup.cfg allows
only its series; tests/repo/test_ci.py keeps those two and `TESTED_TORCH` in agreement.
"""

from __future__ import annotations

import re
import warnings

import torch

from accel_gradsync.config.errors import GradSyncWarning

TESTED_TORCH = "2.13"
"""The torch release series (major.minor) CI runs the suite on."""

_warned: set[str] = set()


def is_tested_torch(version: str) -> bool:
    """True when `version` (a `torch.__version__`) is of the tested series. Patch releases and
    build labels (`2.13.1`, `2.13.0+cpu`, `2.13.0a0+git...`) count: torch changes FSDP2's
    private fields between minor releases, not within one."""
    match = re.match(r"(\d+)\.(\d+)(?![\d])", version)
    return match is not None and f"{match[1]}.{match[2]}" == TESTED_TORCH


def warn_if_untested_torch(version: str = torch.__version__) -> None:
    """One `GradSyncWarning` per process (and version) when torch is not of the tested series."""
    if version in _warned or is_tested_torch(version):
        return
    _warned.add(version)
    warnings.warn(
        f"accel_gradsync: torch {version} is not the release it was tested on (torch {TESTED_TORCH}; "
        f"constraints.txt pins torch=={TESTED_TORCH}.0). It reads FSDP2 private attributes that change "
        "between releases: attach() stops with their names if one is missing, and otherwise runs untested. "
        f"Install torch=={TESTED_TORCH}.0 to run what CI runs.",
        GradSyncWarning,
        stacklevel=3,
    )
