"""Skip FSDP2's own pre- and post-forward on a unit generation keeps unsharded, at forwards without
gradients, where they do nothing; put them back when the unit is released.

A unit kept unsharded (`reshard_after_forward` False, parameters gathered) still runs FSDP2's
pre- and post-forward at every forward, at every decoded token: state changes it undoes by the end
of the forward, an all-gather it finds done, a reshard its flag skips, a post-backward hook it
registers only with gradients, and a record of the forward for backward prefetching
(`post_forward_order`, which grows by one entry per unit per token until the next last backward
clears it). What is left that changes anything: the mixed-precision casts of inputs to
`param_dtype` and of outputs to `output_dtype`, which the skip still applies, and the root's move
of its inputs to its device on an accelerator, where the root is not skipped.

FSDP2 registers its hooks at `fully_shard` and keeps their handles on the unit's `FSDPState`
(`compat/fsdp2.py`: `pre_forward_hook`, `post_forward_hook`; a grouped `fully_shard([a, b])` unit
holds one handle for every module's). `skip_idle_forward_work` puts a gate in the place of each in
the module's hook dict, under the same key, so every hook keeps its order; the call it returns puts
FSDP2's own hooks back. The gate decides at every call: it runs FSDP2's hook unless gradients are
off and every param group of the unit is unsharded, kept, and idle (not mid-forward: a grouped
unit whose first module ran FSDP2's hook runs it on the others too). A forward with gradients thus
runs FSDP2's hooks even inside the forward that restores them (hooks a module runs are fixed when
its forward starts), and a unit resharded meanwhile gathers as before. A post-forward is skipped
only where its module's pre-forward was. A torch whose FSDP2 lacks one of the attributes used gets
no gate (its generation runs as before).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter

NEEDED = ("pre_forward_hook", "post_forward_hook", "cast_forward_inputs", "cast_output_dtype")
"""What the gates read on an `FSDPState`, beyond what bind checks."""
GATED = "_accel_gradsync_gate"
"""Marks a gate (a hook gated already is not gated again)."""


def skip_idle_forward_work(adapter: ModelAdapter, units: Sequence[Unit]) -> Callable[[], None]:
    """Gate FSDP2's forward hooks on every module of `units` (kept unsharded for forwards without
    gradients, see the module docstring), and on the model's FSDP2 root where it is no unit (it
    holds no parameter) and not gated yet; returns the call that puts FSDP2's own hooks back
    (idempotent). Other wrappers, and units this torch's FSDP2 cannot gate: nothing to put back."""
    if not isinstance(adapter, FSDP2Adapter) or not units:
        return lambda: None
    modules_of, grouped, root, on_cpu = _layout(adapter)
    swapped: list[tuple[dict, int, Callable, Callable]] = []
    for unit in units:
        modules = modules_of.get(id(unit), [])
        if root not in modules:
            swapped += _gate(modules, _groups(unit))
        elif on_cpu:  # on an accelerator FSDP2's root moves its inputs to the device: not idle work
            swapped += _gate(modules, _groups(unit) + grouped)
    if on_cpu and not internals.read(cast(FSDPModule, root)._get_fsdp_state(), "param_groups"):
        swapped += _gate([root], grouped)

    def restore() -> None:
        for hooks, key, original, gate in reversed(swapped):
            if hooks.get(key) is gate:  # else someone re-registered FSDP2's hooks meanwhile: leave theirs
                hooks[key] = original
        swapped.clear()

    return restore


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(adapter: FSDP2Adapter) -> tuple[dict[int, list[nn.Module]], list, nn.Module, bool]:
    """What gating a model's units needs, once per adapter (its units never change): each unit's
    modules by `id(unit)`, the param groups of its grouped units, its FSDP2 root, whether FSDP2 runs
    on the CPU."""
    if adapter not in _LAYOUTS:
        modules_of: dict[int, list[nn.Module]] = {}
        for module, unit in adapter.unit_modules():
            modules_of.setdefault(id(unit), []).append(module)
        by_id = {id(u): u for u in adapter.units}
        # The root's forward completes grouped units its forward left incomplete (a grouped unit
        # whose hooks ran while the root's were skipped would stay mid-forward): the root is idle
        # only while they are.
        grouped = [g for key, modules in modules_of.items() if len(modules) > 1 for g in _groups(by_id[key])]
        on_cpu = _device_type(next(g for u in adapter.units for g in _groups(u))) == "cpu"
        _LAYOUTS[adapter] = (modules_of, grouped, adapter.fsdp_root(), on_cpu)
    return _LAYOUTS[adapter]


def _gate(modules: list[nn.Module], groups: list) -> list[tuple[dict, int, Callable, Callable]]:
    """Put gates in the place of FSDP2's hooks on `modules` (every module of one FSDP2 state),
    idle while `groups` are (see `_idle_check`); returns (hook dict, key, FSDP2's hook, gate) for
    each. Hooks gated already (the root, by an earlier call) are left as they are."""
    if not modules:
        return []
    state = cast(FSDPModule, modules[0])._get_fsdp_state()
    if not all(internals.has(state, name) for name in NEEDED):
        return []
    handles = [
        h
        for name in ("pre_forward_hook", "post_forward_hook")
        for h in getattr(internals.read(state, name), "handles", (internals.read(state, name),))
    ]
    cast_inputs = internals.read(state, "cast_forward_inputs")  # each a no-op without a policy that casts
    cast_output = internals.read(state, "cast_output_dtype")
    idle = _idle_check(groups)
    skipped: set[nn.Module] = set()  # modules whose pre-forward the gate skipped, until their post-forward

    def make_pre(fsdp_hook: Callable) -> Callable:
        def gate(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if idle():
                skipped.add(module)
                return cast_inputs(args, kwargs)
            skipped.discard(module)
            return fsdp_hook(module, args, kwargs)

        return gate

    def make_post(fsdp_hook: Callable) -> Callable:
        def gate(module: nn.Module, args: Any, output: Any) -> Any:
            if module in skipped:
                skipped.discard(module)
                return cast_output(output)
            return fsdp_hook(module, args, output)

        return gate

    swapped = []
    for module in modules:
        pre_hooks, post_hooks = _hook_dicts(module)
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not pre_hooks and hooks is not post_hooks:
                continue  # another module's of the same state
            original = hooks.get(handle.id)
            if original is None or getattr(original, GATED, False):
                continue  # removed by someone else, or gated already
            gate = (make_pre if hooks is pre_hooks else make_post)(original)
            setattr(gate, GATED, True)
            hooks[handle.id] = gate
            swapped.append((hooks, handle.id, original, gate))
    return swapped


def _idle_check(groups: list) -> Callable[[], bool]:
    """A call that says FSDP2's forward hooks would do nothing now: no gradients, not traced by
    the compiler (FSDP2's hooks are excluded from graphs: the gate defers to them), and each of
    `groups` unsharded, not resharding after forward and idle."""
    unsharded, after_forward, state = (
        internals.attribute(n) for n in ("is_unsharded", "post_forward_mesh_info", "training_state")
    )

    def idle() -> bool:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        for g in groups:
            if not getattr(g, unsharded) or getattr(g, after_forward) is not None or getattr(g, state).name != "IDLE":
                return False
        return True

    return idle


def _hook_dicts(module: nn.Module) -> tuple[dict, dict]:
    """`module`'s forward pre-hook and forward hook dicts, as the handles of two hooks registered
    and removed at once name them (no private attribute of `nn.Module` read)."""
    pre = module.register_forward_pre_hook(_nothing)
    post = module.register_forward_hook(_nothing)
    pre.remove()
    post.remove()
    pre_hooks, post_hooks = pre.hooks_dict_ref(), post.hooks_dict_ref()
    assert pre_hooks is not None and post_hooks is not None  # the module holds them
    return pre_hooks, post_hooks


def _nothing(*args: Any) -> None:
    return None


def _groups(unit: Unit) -> list:
    """The param groups of a unit's FSDP2 state."""
    return internals.read(cast(FSDPModule, unit.module)._get_fsdp_state(), "param_groups")


def _device_type(group: Any) -> str:
    """The device type of a param group's sharded parameters (FSDP2's own device)."""
    first = internals.read(group, "fsdp_params")[0]
    return internals.read(first, "sharded_param").device.type
