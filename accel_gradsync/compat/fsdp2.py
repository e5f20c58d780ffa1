"""Where FSDP2 keeps the per-unit state this package reads, by torch release series.

FSDP2 has setters for its per-unit flags but no getters, and no API for a param group's held
gradients, training state or pending all-gather, so `runtime/fsdp2_state.py` reads attributes
of FSDP2's private objects (`runtime/fsdp2_grads.py` and `runtime/fsdp2.py` write a few), and
`runtime/quiet_generation.py` reads its forward hooks' handles and casts: the `FSDPState` of a
unit (`module._get_fsdp_state()`), its `FSDPParamGroup`s and their `FSDPParam`s. It does so only
through `read`, `write` and `has` here, by a stable name; `FSDP2_PRIVATE` says, per torch series,
on which object and under which attribute that series keeps each one.

A new torch release is one entry in `FSDP2_PRIVATE` (the previous series' table with what moved
changed) plus one CI stack (stacks/*.txt). A series with no entry is read with the newest
table: `attach` warns once (`versions.warn_if_untested_torch`) and bind stops, naming the first
attribute that torch lacks (`check_fsdp2_internals` in `runtime/fsdp2_state.py`, through `missing`).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import torch

STATE, GROUP, PARAM = "FSDPState", "FSDPParamGroup", "FSDPParam"

_TORCH_2_13: dict[str, tuple[str, str]] = {
    # name: (object, attribute). The state's param groups are a list (torch 2.11 kept one group).
    "param_groups": (STATE, "_fsdp_param_groups"),
    "auto_reshard_after_forward": (STATE, "_auto_reshard_after_forward"),  # the root's automatic False
    "modules_to_run_forward": (STATE, "_modules_to_run_forward"),  # a grouped unit's forwards left
    # FSDP2's forward hooks (one multi-handle for a grouped unit's) and the casts they apply.
    "pre_forward_hook": (STATE, "_pre_forward_hook_handle"),
    "post_forward_hook": (STATE, "_post_forward_hook_handle"),
    "cast_forward_inputs": (STATE, "_cast_forward_inputs"),
    "cast_output_dtype": (STATE, "_cast_output_dtype"),
    "fsdp_params": (GROUP, "fsdp_params"),
    "mp_policy": (GROUP, "mp_policy"),
    "reduce_grads": (GROUP, "reduce_grads"),  # set_requires_gradient_sync writes it
    "all_reduce_grads": (GROUP, "all_reduce_grads"),  # set_requires_all_reduce writes it
    "reshard_after_backward": (GROUP, "reshard_after_backward"),
    "post_forward_mesh_info": (GROUP, "post_forward_mesh_info"),  # None: no reshard after forward
    "partial_reduce_output": (GROUP, "_partial_reduce_output"),  # HSDP's held reduce-scatter output
    "is_unsharded": (GROUP, "is_unsharded"),
    "training_state": (GROUP, "_training_state"),
    "all_gather_result": (GROUP, "_all_gather_result"),  # an all-gather not waited for yet
    "sharded_param": (PARAM, "sharded_param"),
    "unsharded_accumulated_grad": (PARAM, "unsharded_accumulated_grad"),
    "unsharded_param": (PARAM, "_unsharded_param"),  # absent until the first all-gather
    "orig_size": (PARAM, "_orig_size"),
    "module_info": (PARAM, "_module_info"),
}

FSDP2_PRIVATE: dict[str, dict[str, tuple[str, str]]] = {
    "2.13": _TORCH_2_13,
    "2.14": dict(_TORCH_2_13),  # 2.14 keeps every one where 2.13 does
}
"""Per torch series (major.minor): name -> (FSDP2 object, attribute that holds it)."""

_OPTIONAL: tuple[str, ...] = ("unsharded_param", "modules_to_run_forward")  # absent until first gathered / grouped
# What only generation's skip of FSDP2's idle forward work reads (runtime/quiet_generation.py): a
# torch without them generates as before, so bind does not stop for them.
_OPTIONAL += ("pre_forward_hook", "post_forward_hook", "cast_forward_inputs", "cast_output_dtype")
CHECKED_AT_BIND = {
    kind: tuple(name for name, (obj, _) in _TORCH_2_13.items() if obj == kind and name not in _OPTIONAL)
    for kind in (STATE, GROUP, PARAM)
}
"""What bind checks on the first unit, per object: all but `_OPTIONAL`, read with a default."""


def torch_series(version: str = torch.__version__) -> str | None:
    """`major.minor` of a `torch.__version__` (`2.14.0+cu130` -> `2.14`); None if it has none.
    torch changes FSDP2's private fields between minor releases, not within one."""
    match = re.match(r"(\d+)\.(\d+)(?![\d])", version)
    return None if match is None else f"{match[1]}.{match[2]}"


def tabled_series() -> list[str]:
    """The series `FSDP2_PRIVATE` has an entry for, oldest first."""
    return sorted(FSDP2_PRIVATE, key=lambda s: tuple(int(n) for n in s.split(".")))


@cache
def layout(version: str = torch.__version__) -> dict[str, tuple[str, str]]:
    """The table for torch `version`: its series' entry, or the newest one for a series with none."""
    return FSDP2_PRIVATE.get(torch_series(version) or "", FSDP2_PRIVATE[tabled_series()[-1]])


def attribute(name: str) -> str:
    """The attribute that holds `name` in the running torch."""
    return layout()[name][1]


def read(obj: Any, name: str, *default: Any) -> Any:
    """`name` (a key of the table) from `obj`, the FSDP2 object the table puts it on."""
    return getattr(obj, layout()[name][1], *default)


def write(obj: Any, name: str, value: Any) -> None:
    """Set `name` on `obj` (only where torch has no setter: see `runtime/fsdp2_grads.py`)."""
    setattr(obj, layout()[name][1], value)


def has(obj: Any, name: str) -> bool:
    """True when `obj` holds `name` now."""
    return hasattr(obj, layout()[name][1])


def missing(objects: dict[str, Any]) -> str | None:
    """The first of `CHECKED_AT_BIND` that `objects` (FSDP2 object kind -> one such object, or
    None where there is none to check) lack, as `Object.attribute`; None when none is missing."""
    for kind, names in CHECKED_AT_BIND.items():
        obj = objects.get(kind)
        if obj is None:
            continue
        for name in names:
            if not has(obj, name):
                return f"{kind}.{attribute(name)}"
    return None
