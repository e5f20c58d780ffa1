"""The tested torch release: which version strings count as it, and the one warning attach gives
for any other (the missing-attribute error itself is tests/unit/runtime/test_fsdp.py's)."""

import warnings

import pytest
import torch

from accel_gradsync.compat.versions import TESTED_TORCH, is_tested_torch, warn_if_untested_torch
from accel_gradsync.config.errors import GradSyncWarning


@pytest.mark.parametrize(
    "version",
    [
        f"{TESTED_TORCH}.0",
        f"{TESTED_TORCH}.0+cpu",
        f"{TESTED_TORCH}.2+cu128",
        f"{TESTED_TORCH}.0a0+git1a2b3c",
        f"{TESTED_TORCH}.0.dev20260101",
    ],
)
def test_builds_and_patch_releases_of_the_tested_series_count(version):
    assert is_tested_torch(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cpu", "2.14.0", "2.130.0", "3.13.0", "2", "", "nightly"])
def test_other_series_do_not(version):
    assert not is_tested_torch(version)


def test_this_torch_is_the_tested_one():
    """The suite runs on the pinned torch (constraints.txt), so attach warns nothing here."""
    assert is_tested_torch(torch.__version__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested_torch()


def test_an_untested_torch_is_named_once_with_the_tested_one():
    with pytest.warns(GradSyncWarning, match=rf"torch 2\.11\.0\+cpu is not .* tested on \(torch {TESTED_TORCH};"):
        warn_if_untested_torch("2.11.0+cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested_torch("2.11.0+cpu")  # once per process
