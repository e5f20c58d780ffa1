"""Count FSDP2's all-gathers and reductions from what FSDP2 does, not from what the plan expects.

What a unit issues depends on more than its flags. Anything can reshard it between two of its
forwards: a `state_dict()` in the middle of a window (`save_state` takes one), an evaluation,
`FSDPModule.reshard()`, FSDP's recovery after an exception. A model forwarded twice per
micro-batch runs a unit's post-backward once per forward whose inputs need gradients, and each
one that finds a gradient reduces it: once the held gradients of a window, once more the
gradient of the last micro-batch. So the counters read FSDP2's state at the moment FSDP acts:

- before a unit's forward (a pre-hook prepended before FSDP's own pre-forward, and after
  generation's, which may reshard what it kept): whether its params are unsharded now;
- before its pre-backward (a hook on each output tensor, registered before FSDP registers its
  own on the same tensors; for a grouped unit the root's post-forward completes, on the root's
  outputs): the same;
- before each of its post-backwards: a pre-hook on the autograd node FSDP's pre-forward puts on
  the unit's inputs, and a callback queued at the first pre-backward, so that it runs before
  FSDP's end-of-backward callback, for the units that post-backward runs.

A unit FSDP prefetched counts once: its params stay sharded until it waits for that all-gather,
or, when nothing does (FSDP's backward prefetch follows the order of the forwards before it, an
evaluation's included), at the end of the backward.

FSDP also runs a pre-forward where no module hook runs: a method registered with
`register_fsdp_forward_method` (transformers' Trainer registers the root's `generate`) gathers the
unit before the method and no forward of that module follows. Such an all-gather leaves a param
group unsharded that no count accounted for; the next unit's pre-forward finds it so and counts it
(`_Residency`). What FSDP reshards after a backward is seen after its end-of-backward callback.
The reads are attribute reads (fsdp2_state.py); the hooks are registered where FSDP registers its own.
FSDP1 and DDP models get none: their collectives are counted per micro-batch (accounting.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.core.accounting import SyncAccounting
from accel_gradsync.runtime.wrappers.adapt import sharded_by_transformers
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.wrappers.fsdp2_state import (
    forwards_left,
    param_groups,
    pending_all_gathers,
    pending_reduction,
    post_backward_group,
    ran_post_backward,
    unsharded,
    unused_prefetch,
)


def watch_fsdp2(adapter: ModelAdapter, account: SyncAccounting) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks on each FSDP2 unit module of `adapter`'s model that count into `account` the
    all-gathers, reduce-scatters and all-reduces FSDP2 issues for it. None for other wrappers."""
    if not isinstance(adapter, FSDP2Adapter):
        return []
    residency = _Residency(adapter, account)
    end_of_backward = _EndOfBackward(adapter, account, residency)
    handles = []
    for module, unit in adapter.unit_modules():
        gather = residency.gatherer(unit)
        handles.append(module.register_forward_pre_hook(_before_forward(gather, residency), prepend=True))
        handles.append(module.register_forward_pre_hook(_on_inputs(adapter, unit, account), with_kwargs=True))
        handles.append(module.register_forward_hook(_on_outputs(gather, end_of_backward), prepend=True))
    handles.append(
        adapter.fsdp_root().register_forward_hook(_on_root_outputs(adapter, residency, end_of_backward), prepend=True)
    )
    return handles


class _Residency:
    """The param groups whose unsharded params an all-gather counted here accounts for: the ones
    found unsharded without one were gathered where no module hook runs, and count when found."""

    def __init__(self, adapter: FSDP2Adapter, account: SyncAccounting) -> None:
        self.adapter = adapter
        self.account = account
        self.groups = [g for unit in adapter.units if unit.shard_size > 1 for g in param_groups(unit)]
        # Gathered before the hooks were there: not this run's to count.
        self.counted = {id(g) for g in self.groups if unsharded(g)}
        self.flag = internals.attribute("is_unsharded")

    def gatherer(self, unit: Unit) -> Callable[[bool], None]:
        """Count the all-gathers FSDP issues for `unit` when it acts on it now (`training`: with
        gradients); its groups are accounted for from then on."""
        pending = pending_all_gathers(unit)
        ids = [id(g) for g in param_groups(unit)] if unit.shard_size > 1 else []
        counted = self.counted

        def gather(training: bool) -> None:
            gathers = pending()
            if gathers:
                self.account.record_all_gathers(gathers, training=training)
            counted.update(ids)

        return gather

    def sweep(self) -> None:
        """Count the groups unsharded since the last look without a count; forget the resharded."""
        # NOTE: runs before every unit's forward, so at every decoded token once per unit: one
        # attribute read per group, no call in between.
        flag, counted = self.flag, self.counted
        for group in self.groups:
            if not getattr(group, flag):
                counted.discard(id(group))
            elif id(group) not in counted:
                counted.add(id(group))
                self.account.record_all_gathers(1, training=torch.is_grad_enabled())


class _EndOfBackward:
    """Counts what FSDP2's end-of-backward callback reduces (the post-backward of every unit that
    did not run one through its inputs: the root, a first layer, a unit this backward skipped) and
    the prefetched all-gathers it drops unused."""

    def __init__(self, adapter: FSDP2Adapter, account: SyncAccounting, residency: _Residency) -> None:
        self.adapter = adapter
        self.account = account
        self.residency = residency
        self.queued = False
        # Each unit's param groups, read once (as `_Residency` does): the count runs every backward.
        self.groups = [(unit, param_groups(unit)) for unit in adapter.units]

    def queue(self) -> None:
        """At a pre-backward: queue `count` once per backward, ahead of FSDP's own callback."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.count)

    def count(self) -> None:
        self.queued = False
        account, hsdp = self.account, self.adapter.hsdp
        for unit, groups in self.groups:
            for group in groups:
                if not ran_post_backward(group):
                    account.record_reduction(*pending_reduction(unit, group, hsdp))
                if unused_prefetch(unit, group):
                    account.record_all_gathers(1, training=True)
        # Queued from a callback, it runs after FSDP's, which reshards after the backward.
        torch.autograd.Variable._execution_engine.queue_callback(self.residency.sweep)


def _before_forward(gather: Callable[[bool], None], residency: _Residency) -> Callable:
    def hook(module: nn.Module, args: Any) -> None:
        residency.sweep()
        gather(torch.is_grad_enabled())

    return hook


def _on_inputs(adapter: FSDP2Adapter, unit: Unit, account: SyncAccounting) -> Callable:
    """After FSDP's pre-forward: a pre-hook on each post-backward node it put on the inputs."""
    ids = {id(g) for g in param_groups(unit)}  # the groups stay alive with the unit: ids stay theirs

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return
        seen: list = []
        for tensor in _grad_tensors((args, kwargs)):
            node = tensor.grad_fn
            if node is None or any(node is n for n in seen):
                continue
            group = post_backward_group(node)
            if group is None or id(group) not in ids:
                continue
            seen.append(node)
            node.register_prehook(_before_post_backward(adapter, unit, group, account))

    return hook


def _before_post_backward(adapter: FSDP2Adapter, unit: Unit, group: Any, account: SyncAccounting) -> Callable:
    def prehook(grad_outputs: Any) -> None:
        account.record_reduction(*pending_reduction(unit, group, adapter.hsdp))

    return prehook


def _on_outputs(gather: Callable[[bool], None], end_of_backward: _EndOfBackward) -> Callable:
    def before_pre_backward(grad: torch.Tensor) -> None:
        # Several outputs, or several forwards' outputs: the first finds the unit sharded and FSDP
        # gathers it right after; the others find it unsharded, unless a post-backward in between
        # resharded it and FSDP gathers it again.
        end_of_backward.queue()
        gather(True)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in _grad_tensors(output):
                tensor.register_hook(before_pre_backward)

    return hook


def _on_root_outputs(adapter: FSDP2Adapter, residency: _Residency, end_of_backward: _EndOfBackward) -> Callable:
    """Before the root's post-forward: the backward reaches the root's outputs first, so the
    end-of-backward count is queued there, ahead of FSDP's; the grouped units the root's
    post-forward completes get their pre-backward there, so their count goes there too."""
    completions = [(unit, _on_outputs(residency.gatherer(unit), end_of_backward)) for unit in adapter.units]

    def queue(grad: torch.Tensor) -> None:
        end_of_backward.queue()

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for tensor in _grad_tensors(output):
            tensor.register_hook(queue)
        for unit, register in completions:
            if forwards_left(unit):
                register(module, args, output)

    return hook


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors that require grad in a forward's inputs or output, in order: in tuples, lists,
    dicts (transformers' `ModelOutput`) and dataclasses, where FSDP2 finds them for its hooks."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    # NOTE: runs on every unit's inputs and outputs at every forward: a list filled in place, and
    # a tensor in a tuple or list (a forward's positional inputs) taken without another call.
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                if item.requires_grad:
                    found.append(item)
            else:
                _collect(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _collect(getattr(value, f.name), found)


def watch_replicated_all_reduces(trainer: Any, params: list, record: Callable[[], None]) -> list:
    """Count the all-reduces transformers' Trainer issues itself for `params`, trainable
    parameters FSDP2 does not manage (an adapter added after load-time sharding): its
    `_sync_replicated_trainable_parameters` gives each a post-accumulate-grad hook that averages
    the gradient over all ranks when the accelerator syncs gradients (the window's last backward).
    One hook of the same kind per parameter calls `record` on the same condition; returns the
    handles."""
    import torch.distributed as dist

    if not (sharded_by_transformers(trainer) and dist.is_initialized() and dist.get_world_size() > 1):
        return []  # transformers issues none

    def count(_param: Any) -> None:
        if trainer.accelerator.sync_gradients:
            record()

    return [p.register_post_accumulate_grad_hook(count) for p in params]
