"""`GradSyncConfig`: the one place every accel_gradsync default lives.

Every field follows accelerate's plugin convention: an explicit value wins, then the
environment variable `ACCEL_GRADSYNC_<FIELD>` (upper case), then the default in `DEFAULTS`.
Fields therefore default to `None` ("not set"), which is also what `HfArgumentParser` /
`TrlParser` hand over when a flag is absent, so the environment still applies under a
recipe's command line.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

ENV_PREFIX = "ACCEL_GRADSYNC_"

# The single source of every default. `GradSyncConfig()` with an empty environment, the
# recipe's `--help`, a recipe YAML without the key and the environment all resolve to these.
DEFAULTS: dict[str, Any] = {
    # Per-micro-batch sync is the memory-safe choice: deferral holds the whole unsharded
    # gradient on every rank, which is the OOM users hit when it is on by default.
    "defer": False,
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass
class GradSyncConfig:
    """How gradients are synchronised during gradient accumulation.

    Usable directly (`GradSyncConfig(defer=True)`), from the environment
    (`ACCEL_GRADSYNC_DEFER=1`), and as a dataclass for `transformers.HfArgumentParser` or
    `trl.TrlParser` (`--defer-grad-sync`, or `defer: true` in a recipe YAML).
    """

    defer: Optional[bool] = field(
        default=None,
        metadata={
            "help": (
                "Defer the gradient reduce-scatter (FSDP) / all-reduce (DDP) of every micro-batch but "
                "the last one of each optimizer step: M times fewer collectives, but every rank holds "
                "the whole unsharded gradient between micro-batches. Off: sync after every micro-batch "
                f"(sharded gradients, lowest memory). Default: {DEFAULTS['defer']}. "
                f"Environment: {ENV_PREFIX}DEFER."
            ),
            "aliases": ["--defer-grad-sync", "--defer_grad_sync"],
            # A bare `--defer-grad-sync` means True, as for transformers' own bool flags.
            "nargs": "?",
            "const": True,
        },
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            source = f"GradSyncConfig.{f.name}"
            if value is None:
                env_name = ENV_PREFIX + f.name.upper()
                if env_name in os.environ:
                    value, source = os.environ[env_name], env_name
                else:
                    value = DEFAULTS[f.name]
            setattr(self, f.name, _coerce(f.name, value, source))

    @property
    def mode(self) -> str:
        """Name of the sync policy this config selects (see `accel_gradsync.policies.POLICIES`)."""
        return "deferred" if self.defer else "per_micro_batch"


def _coerce(name: str, value: Any, source: str) -> Any:
    """Validate one field, accepting the string spellings a CLI, YAML or environment gives."""
    expected = type(DEFAULTS[name])
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(
            f"{source}={value!r} is not a valid value for `{name}`; valid choices: "
            f"True or False (also {', '.join(_TRUE + _FALSE)} as text)."
        )
    raise AssertionError(f"no validator for field type {expected!r}")  # invariant: DEFAULTS covers all fields
