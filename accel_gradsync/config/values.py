"""How a setting's text becomes its value, alike from every source (the environment, a command
line, a recipe YAML, the dataclass): booleans in any of `BOOLEAN_SPELLINGS`, memory sizes with a
unit or as a fraction of free memory. settings.py validates each field with these; the error
messages name the source and the value, so a caller passes both.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

_TRUE = ("true", "yes", "on", "y", "t", "1")
_FALSE = ("false", "no", "off", "n", "f", "0")
BOOLEAN_SPELLINGS = "true/false, yes/no, on/off, y/n, t/f or 1/0 (any case)"
"""What every source (environment, command line, recipe YAML) accepts for a boolean setting."""


def parse_bool(value: Any, source: str = "", name: str = "") -> bool:
    """A boolean setting as any source gives it: a bool, the int 0 or 1 (YAML's `1`), or one of
    `BOOLEAN_SPELLINGS`. The error message names `source` (where the value came from) and the
    field `name` where they are known."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):  # other ints are more likely a slip than a choice
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in _TRUE + _FALSE:
        return text in _TRUE
    raise ValueError(
        f"{source}{'=' if source else ''}{value!r} is not a valid value{f' for `{name}`' if name else ''}; "
        f"a boolean is one of {BOOLEAN_SPELLINGS}."
    )


if TYPE_CHECKING:
    Boolean = bool
else:

    class Boolean:
        """The annotation of the boolean settings, so that a command line and a recipe YAML read
        them with `parse_bool` as the environment does: `HfArgumentParser` / `TrlParser` give a
        field annotated `bool` transformers' own parser, which takes other spellings, and give
        any other class to argparse as the type to call. `Boolean("on")` is the bool True; type
        checkers see `bool`."""

        def __new__(cls, text: str) -> bool:
            try:
                return parse_bool(text)
            except ValueError as error:  # argparse prints this message after the flag's name
                raise argparse.ArgumentTypeError(str(error)) from None


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class MemorySize(NamedTuple):
    """A memory size as a setting gives it: `bytes` (`12GiB`) or a `fraction` of free memory
    (`0.25`), exactly one of them."""

    bytes: int | None
    fraction: float | None

    def of(self, free_memory: Callable[[], int]) -> int:
        """In bytes: the absolute size, or the fraction of `free_memory()` (read only then)."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None  # parse_bytes gives one of the two
        return int(self.fraction * free_memory())


def parse_bytes(text: str, source: str = "memory size", fraction_ok: bool = True) -> MemorySize:
    """`12GiB` -> (bytes, None); `0.25` -> (None, fraction). Raises ValueError otherwise."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    number = float(match.group(1)) if match else 0.0
    if not match or unit not in _UNITS and unit != "" or number < 0:
        raise ValueError(
            f"{source}={text!r} is not a memory size{': it must be >= 0' if number < 0 else ''}; use a number "
            "with a unit B, KiB, MiB or GiB "
            + (
                "(e.g. 12GiB) or a fraction of free memory between 0 and 1 (e.g. 0.5)."
                if fraction_ok
                else "(e.g. 40GiB)."
            )
        )
    if unit:
        return MemorySize(int(number * _UNITS[unit]), None)
    if not 0 <= number <= 1:
        raise ValueError(
            f"{source}={text!r}: a number without a unit is a fraction of free memory and must lie "
            "between 0 and 1; add a unit (B, KiB, MiB, GiB) for an absolute size."
        )
    return MemorySize(None, number)
