"""Where FSDP2 keeps the per-unit state this package reads, and how it holds deferred gradients,
by torch release series.

FSDP2 has setters for its per-unit flags but no getters, and no API for a param group's held
gradients, training state or pending all-gather, so `runtime/wrappers/fsdp2_state.py` reads attributes
of FSDP2's private objects (`runtime/wrappers/fsdp2_grads.py` and `runtime/wrappers/fsdp2.py` write a few), and
`runtime/wrappers/quiet_generation.py` reads its forward hooks' handles and casts: the `FSDPState` of a
unit (`module._get_fsdp_state()`, the one private method, the entry to all of them), its
`FSDPParamGroup`s and their `FSDPParam`s. It does so only through `read`, `write` and `has` here,
by a stable name; `FSDP2_PRIVATE` says, per torch series, on which object and under which
attribute that series keeps each one, and `WHY_PRIVATE` why no public API gives it.

What a series does differently, beyond where it keeps things, is its `FSDP2Release`
(`FSDP2_RELEASES`): torch 2.15 accumulates deferred gradients on the unsharded parameter's
`.grad` in the parameter's `grad_dtype` (2.13 and 2.14: `FSDPParam.unsharded_accumulated_grad`,
cast to `reduce_dtype`, else the compute dtype), reduces mixed gradient dtypes in one
reduce-scatter, and its public `reset_iter_state()` discards held gradients. The runtime asks the
release, never the version.

What stays private, and why (2.15's public API was checked for each; see `WHY_PRIVATE`):
- 2.13, 2.14: all of `_TORCH_2_13` (22 attributes).
- 2.15: the same less `unsharded_accumulated_grad` (2.15 holds in `.grad`; its property of that
  name only forwards there) and `orig_size` (its only use, `even_out`'s zero gradients, is for
  2.13/2.14's uniform-dtype assertion), plus `partial_reduce_output_layout` (2.15 packs HSDP's
  held partial sum per param, so a mid-window checkpoint puts the layout back with it): 21.
  Dropping an aborted window's gradients moves to the public `FSDPModule.reset_iter_state()`, so
  2.15 writes a held gradient (the unsharded parameter's `.grad`) and HSDP's partial sum only to
  put back a mid-window checkpoint; 2.13/2.14 also write them to even out dtypes and to drop an
  aborted window (`compat/fsdp2_grads.py` holds what each series does with a held gradient).
- 2.15's new public methods replace none of the rest: `set_manual_backward_finalization` /
  `finalize_backward` hand the end of backward to the caller, and the loops this package joins
  (accelerate's, the Trainer's, TRL's) call `backward()` and never `finalize_backward`, so turning
  it on would leave their gradients unreduced (and it refuses HSDP with only the all-reduce held,
  `defer_all_reduce`); the counters still need their callback ahead of FSDP's. Nor is
  `set_keep_unsharded_storage` a window: it keeps the storage's address (for CUDA graphs) but
  the params are all-gathered again into it, which is what windowing avoids. The flags' setters
  still have no getters, the groups no accessor.

A new torch release is one entry in `FSDP2_PRIVATE` and `FSDP2_RELEASES` (the previous series'
with what moved changed) plus one CI stack (stacks/*.txt). A series with no entry is read with the
newest one: `attach` warns once (`versions.warn_if_untested_torch`) and bind stops, naming the
first attribute that torch lacks (`check_fsdp2_internals` in `runtime/wrappers/fsdp2_state.py`, through
`missing`). tests/unit/compat/test_fsdp2.py prints the count per series and holds it to
`PRIVATE_CEILING`, so that it only goes down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    "reduce_grads": (GROUP, "reduce_grads"),  # set_requires_gradient_sync writes it
    "all_reduce_grads": (GROUP, "all_reduce_grads"),  # set_requires_all_reduce writes it
    "reshard_after_backward": (GROUP, "reshard_after_backward"),
    "post_forward_mesh_info": (GROUP, "post_forward_mesh_info"),  # None: no reshard after forward
    "partial_reduce_output": (GROUP, "_partial_reduce_output"),  # HSDP's held reduce-scatter output
    "is_unsharded": (GROUP, "is_unsharded"),
    "training_state": (GROUP, "_training_state"),
    "all_gather_result": (GROUP, "_all_gather_result"),  # an all-gather not waited for yet
    # Per FSDPParam: 2.15 resolves the policy per parameter (`param_dtype_override_fn`); 2.13 and
    # 2.14 keep the group's policy on each FSDPParam as well as on the group.
    "mp_policy": (PARAM, "mp_policy"),
    "sharded_param": (PARAM, "sharded_param"),
    "unsharded_accumulated_grad": (PARAM, "unsharded_accumulated_grad"),
    "unsharded_param": (PARAM, "_unsharded_param"),  # absent until the first all-gather
    "orig_size": (PARAM, "_orig_size"),
    "module_info": (PARAM, "_module_info"),
}

_TORCH_2_15 = {
    name: where for name, where in _TORCH_2_13.items() if name not in ("unsharded_accumulated_grad", "orig_size")
}
# Which param each slice of HSDP's held partial sum belongs to: 2.15 packs it per param and
# zero-fills a partial whose layout it does not know, so a checkpoint's partial goes back with it.
_TORCH_2_15["partial_reduce_output_layout"] = (GROUP, "_partial_reduce_output_layout")

FSDP2_PRIVATE: dict[str, dict[str, tuple[str, str]]] = {
    "2.13": _TORCH_2_13,
    "2.14": dict(_TORCH_2_13),  # 2.14 keeps every one where 2.13 does
    "2.15": _TORCH_2_15,  # every one it keeps where 2.13 does; two it has no use for
}
"""Per torch series (major.minor): name -> (FSDP2 object, attribute that holds it)."""

WHY_PRIVATE: dict[str, str] = {
    "param_groups": "a unit's param groups: FSDPModule has no accessor for its groups or FSDPParams",
    "auto_reshard_after_forward": "fully_shard's automatic choice for the root (reshard_after_forward=None): "
    "no getter, and set_reshard_after_forward takes a bool, so restoring it after a window is a write",
    "modules_to_run_forward": "a grouped unit's modules still to run forward: no public state",
    "pre_forward_hook": "generation skips FSDP2's hooks of an idle unit: no public switch for them",
    "post_forward_hook": "as pre_forward_hook",
    "cast_forward_inputs": "the input cast generation applies itself where it skips the hook",
    "cast_output_dtype": "the output cast, likewise",
    "fsdp_params": "a group's FSDPParams: no accessor",
    "reduce_grads": "what set_requires_gradient_sync wrote: no getter (2.15 neither)",
    "all_reduce_grads": "what set_requires_all_reduce wrote: no getter (2.15 neither)",
    "reshard_after_backward": "what set_reshard_after_backward wrote: no getter (2.15 neither)",
    "post_forward_mesh_info": "what set_reshard_after_forward wrote (None: keeps): no getter; written to "
    "restore an int or the root's automatic value, which the bool setter cannot express",
    "partial_reduce_output": "HSDP's reduce-scattered sum held while the all-reduce is: counted, saved with a "
    "mid-window checkpoint and put back; no API (2.13/2.14 also drop it by hand: their reset keeps it)",
    "is_unsharded": "whether a group's params are unsharded now, read by the live counters: no getter",
    "training_state": "whether a group ran its post-backward in this backward: no public state",
    "all_gather_result": "a prefetched all-gather nothing waited for: no public state",
    "mp_policy": "the MixedPrecisionPolicy fully_shard was given, for the held and reduce dtypes: no getter",
    "sharded_param": "the DTensor an FSDPParam stands for (the module holds it only while sharded)",
    "unsharded_accumulated_grad": "2.13/2.14's held gradient in reduce_dtype: no API; written to even out "
    "dtypes, drop an aborted window and put back a checkpoint",
    "unsharded_param": "the unsharded parameter whose .grad holds deferred gradients while the module holds "
    "the sharded one: no API (its .grad is written to put back a checkpoint)",
    "orig_size": "a parameter's unsharded shape, for 2.13/2.14's zero gradients (even_out)",
    "partial_reduce_output_layout": "2.15: which param each slice of HSDP's held partial sum belongs to, saved "
    "and put back with it (2.15 zero-fills a partial whose layout it lacks); no API",
    "module_info": "the module and attribute an FSDPParam is registered on (a model loaded after sharding)",
}
"""Why each name is read privately: what it is for, and why no public FSDP2 API gives it."""

PRIVATE_CEILING: dict[str, int] = {"2.13": 22, "2.14": 22, "2.15": 21}
"""The most private attributes a series may read: a change may lower it, never raise it."""


@dataclass(frozen=True)
class FSDP2Release:
    """How one torch series' FSDP2 holds deferred gradients (what differs beyond `FSDP2_PRIVATE`)."""

    series: str
    grads_follow_grad_dtype: bool
    """With `reduce_dtype=None`, held and reduce-scattered gradients are in the parameter's
    `grad_dtype` (its own dtype unless set: fp32 for fp32 params under a bf16 `param_dtype`):
    2.15. False: in the compute dtype (`param_dtype`), as 2.13/2.14 and FSDP1 do."""
    holds_in_grad: bool
    """Held gradients stay on the unsharded parameter's `.grad`, in their held dtype, and one
    reduce-scatter takes mixed dtypes (2.15). False: a gradient to be cast moves to
    `FSDPParam.unsharded_accumulated_grad`, and a reduce-scatter asserts one dtype, so a unit
    never gathered cannot hold yet and params without a gradient get a zero one (`even_out`)."""
    reset_drops_held_grads: bool
    """`FSDPModule.reset_iter_state()` discards held gradients and HSDP's partial sums (2.15):
    an aborted window is dropped through it. False: it keeps them, and they are dropped by hand."""


FSDP2_RELEASES: dict[str, FSDP2Release] = {
    "2.13": FSDP2Release("2.13", grads_follow_grad_dtype=False, holds_in_grad=False, reset_drops_held_grads=False),
    "2.14": FSDP2Release("2.14", grads_follow_grad_dtype=False, holds_in_grad=False, reset_drops_held_grads=False),
    "2.15": FSDP2Release("2.15", grads_follow_grad_dtype=True, holds_in_grad=True, reset_drops_held_grads=True),
}


def torch_series(version: str = torch.__version__) -> str | None:
    """`major.minor` of a `torch.__version__` (`2.14.0+cu130` -> `2.14`); None if it has none.
    torch changes FSDP2's private fields between minor releases, not within one."""
    match = re.match(r"(\d+)\.(\d+)(?![\d])", version)
    return None if match is None else f"{match[1]}.{match[2]}"


def tabled_series() -> list[str]:
    """The series `FSDP2_PRIVATE` has an entry for, oldest first."""
    return sorted(FSDP2_PRIVATE, key=lambda s: tuple(int(n) for n in s.split(".")))


@cache
def release(version: str | None = None) -> FSDP2Release:
    """The `FSDP2Release` of torch `version` (a version or a series; None: the running torch),
    the newest one for a series with no entry."""
    series = torch_series(torch.__version__ if version is None else version) or ""
    return FSDP2_RELEASES.get(series, FSDP2_RELEASES[tabled_series()[-1]])


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
    """Set `name` on `obj` (only where torch has no setter: see `runtime/wrappers/fsdp2_grads.py`)."""
    setattr(obj, layout()[name][1], value)


def has(obj: Any, name: str) -> bool:
    """True when `obj` holds `name` now."""
    return hasattr(obj, layout()[name][1])


_OPTIONAL: tuple[str, ...] = ("unsharded_param", "modules_to_run_forward")  # absent until first gathered / grouped
# What only generation's skip of FSDP2's idle forward work reads (runtime/wrappers/quiet_generation.py): a
# torch without them generates as before, so bind does not stop for them.
_OPTIONAL += ("pre_forward_hook", "post_forward_hook", "cast_forward_inputs", "cast_output_dtype")


def checked_at_bind(version: str = torch.__version__) -> dict[str, tuple[str, ...]]:
    """What bind checks on the first unit, per object: all of the series' table but `_OPTIONAL`,
    which are read with a default."""
    table = layout(version)
    return {
        kind: tuple(name for name, (obj, _) in table.items() if obj == kind and name not in _OPTIONAL)
        for kind in (STATE, GROUP, PARAM)
    }


def missing(objects: dict[str, Any]) -> str | None:
    """The first of `checked_at_bind()` that `objects` (FSDP2 object kind -> one such object, or
    None where there is none to check) lack, as `Object.attribute`; None when none is missing."""
    for kind, names in checked_at_bind().items():
        obj = objects.get(kind)
        if obj is None:
            continue
        for name in names:
            if not has(obj, name):
                return f"{kind}.{attribute(name)}"
    return None
