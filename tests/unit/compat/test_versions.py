"""The tested torch series: which version strings count as one, and the one warning attach gives
for any other (the missing-attribute error itself is tests/unit/runtime/wrappers/test_fsdp2_state.py's)."""

import warnings

import pytest
import torch

from accel_gradsync.compat.versions import TESTED_TORCH, describe_tested_torch, is_tested_torch, warn_if_untested_torch
from accel_gradsync.config.errors import GradSyncWarning


def test_the_tested_series_are_the_two_that_vllm_pins_and_the_newest():
    """vLLM 0.31/0.32 pin torch 2.13.0, vLLM 0.33 torch 2.14.0, and `pip install torch` gives
    2.15.0 (README, Install)."""
    assert TESTED_TORCH == ("2.13", "2.14", "2.15")
    assert describe_tested_torch() == "torch 2.13, 2.14 or 2.15"


@pytest.mark.parametrize("series", TESTED_TORCH)
@pytest.mark.parametrize("suffix", [".0", ".0+cpu", ".2+cu128", ".0+cu130", ".0a0+git1a2b3c", ".0.dev20260101"])
def test_builds_and_patch_releases_of_a_tested_series_count(series, suffix):
    assert is_tested_torch(series + suffix)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cpu", "2.16.0", "2.130.0", "3.13.0", "2", "", "nightly"])
def test_other_series_do_not(version):
    assert not is_tested_torch(version)


@pytest.mark.compat
def test_this_torch_is_a_tested_one():
    """The suite runs on a pinned torch (constraints.txt, stacks/*.txt), so attach warns nothing here."""
    assert is_tested_torch(torch.__version__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested_torch()


def test_torch_2_14_and_2_15_get_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested_torch("2.14.0+cu130")
        warn_if_untested_torch("2.14.1")
        warn_if_untested_torch("2.15.0+cu132")
        warn_if_untested_torch("2.15.0")


def test_an_untested_torch_is_named_once_with_the_tested_ones():
    with pytest.warns(
        GradSyncWarning,
        match=r"torch 2\.16\.0 is not a release it was tested on \(torch 2\.13, 2\.14 or 2\.15;.*torch==2\.15\.0",
    ):
        warn_if_untested_torch("2.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_untested_torch("2.16.0")  # once per process
