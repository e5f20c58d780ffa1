"""config/values.py: a setting's text read alike from every source (the entry points' agreement
on each field: test_settings.py)."""

import argparse

import pytest

from accel_gradsync.config.values import BOOLEAN_SPELLINGS, Boolean, parse_bool, parse_bytes


@pytest.mark.parametrize("text", ["true", "Yes", " ON ", "y", "T", "1", 1, True])
def test_every_true_spelling(text):
    assert parse_bool(text) is True


@pytest.mark.parametrize("text", ["false", "No", "off", "N", "f", "0", 0, False])
def test_every_false_spelling(text):
    assert parse_bool(text) is False


@pytest.mark.parametrize("value", ["maybe", 2, 1.0, None, ""])
def test_anything_else_is_refused_naming_source_field_and_spellings(value):
    with pytest.raises(ValueError) as refused:
        parse_bool(value, "ACCEL_GRADSYNC_DEFER", "defer")
    assert f"ACCEL_GRADSYNC_DEFER={value!r}" in str(refused.value) and "`defer`" in str(refused.value)
    assert BOOLEAN_SPELLINGS in str(refused.value)


def test_a_command_line_reads_booleans_as_the_environment_does():
    assert Boolean("on") is True and Boolean("0") is False
    with pytest.raises(argparse.ArgumentTypeError, match="a boolean is one of"):
        Boolean("enabled")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GiB", (12 * 1024**3, None)), ("1.5 MiB", (3 * 512 * 1024, None)), ("7b", (7, None)), ("0.25", (None, 0.25))],
)
def test_sizes_with_a_unit_are_bytes_and_bare_numbers_fractions(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "fraction_ok", "says"),
    [
        ("12GB", True, "B, KiB, MiB or GiB"),
        ("-1GiB", True, "it must be >= 0"),
        ("1.5", True, "between 0 and 1"),
        ("0.5", False, None),  # a fraction is parsed; settings.py refuses it where it cannot be one
        ("lots", False, "(e.g. 40GiB)"),
    ],
)
def test_bad_sizes_say_what_a_size_is(text, fraction_ok, says):
    if says is None:
        assert parse_bytes(text, "x", fraction_ok) == (None, 0.5)
        return
    with pytest.raises(ValueError, match=r"x=") as refused:
        parse_bytes(text, "x", fraction_ok)
    assert says in str(refused.value)
