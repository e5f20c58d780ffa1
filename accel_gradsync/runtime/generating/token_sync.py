"""Generation without transformers' per-token all-reduce where no rank's forward issues a collective.

transformers' `generate` defaults `synced_gpus` to True for a model FSDP manages (and under
DeepSpeed ZeRO-3) on more than one rank: at every decoded token each rank all-reduces whether its
sequences are done, and a rank that is done keeps running forwards until every rank is. It must
where each forward all-gathers sharded units, since every rank has to join each all-gather. Where
every FSDP2 unit of the model stays unsharded from a generation's first forward on (the window's
units, `gather_for_generation`, `gathered()`), only that first forward all-gathers, and every rank
runs it; no later forward issues a collective, so the per-token all-reduce only holds each rank to
the slowest at every token. DDP's `generate` runs none.

Kept units are not enough: a forward may issue collectives of its own at every token (tensor
parallel over a 2-D mesh, an MoE all-to-all, context parallel, a model's own `all_reduce`), and a
rank that stopped early would leave the others waiting in one. Nor may a forward draw random
numbers (dropout active while it generates: TRL generates in train mode, and PEFT's
`lora_dropout` defaults to 0.05): under the sync the rank done first runs its forwards on and
draws with them, so without it that rank's random state, and every dropout mask and sample after
it, would leave stock's. So the per-token sync goes off only for a model proven free of both
(`SyncProof`): a generation left to transformers' default counts the c10d operations (a
`TorchDispatchMode`) in its second forward, the first that finds the units gathered, and compares
the default generators' states around it; nothing there, and later generations in the same mode
(train or eval: dropout draws in one only) run without the sync; a collective, and the sync stays
on for good; a draw, and it stays on in that mode. The first generation with units kept in each
mode thus runs synced, and one forward of it pays the mode's per-operation cost.

`skip_token_sync` wraps `generate` on each transformers `GenerationMixin` module of a bound model
(the root; a PEFT model's inner transformers model, whose `generate` is the one that decides):
when `kept()` holds at the call and the module is proven free of collectives and draws, `synced_gpus` left
unset is passed as False; a value the caller passes is kept. The wrapper is an instance
attribute, as `register_fsdp_forward_method` sets one (transformers' Trainer registers `generate`
so); no class is touched. Removing the handle takes
the wrapper off where it is still the instance's `generate` (else whoever wrapped it after keeps
theirs, and ours passes calls through). A torch or transformers whose `generate` takes no
`synced_gpus` gets no wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ARGUMENT = "synced_gpus"
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
"""Operator namespaces of collectives: the process group's ops, the functional ones DTensor and
compiled code issue."""


class _CollectiveCount(TorchDispatchMode):
    """Counts the collective operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.count += 1
        return func(*args, **(kwargs or {}))


class SyncProof:
    """Whether a generation module's forwards after a generation's first issue no collective
    (`collectives`, for good) and draw no random number (`draws`, per train or eval mode): each
    unknown until a generation with two forwards or more in that mode was watched (`watching`)."""

    def __init__(self) -> None:
        self.collectives: bool | None = None
        self.draws: dict[bool, bool] = {}  # by the module's `training`

    def settled(self, training: bool) -> bool:
        return self.collectives is True or (self.collectives is not None and training in self.draws)

    def free(self, training: bool) -> bool:
        return self.collectives is False and self.draws.get(training) is False

    @contextlib.contextmanager
    def watching(self, module: nn.Module) -> Iterator[None]:
        """One `generate` of `module` with transformers' sync: count the collectives of its second
        forward (the first gathers the units), see whether it drew, and settle both."""
        forwards, mode, states = [0], _CollectiveCount(), []
        training = module.training

        def before(_: nn.Module, args: Any) -> None:
            forwards[0] += 1
            if forwards[0] == 2:
                states.append(_generator_states())
                mode.__enter__()

        def after(_: nn.Module, args: Any, output: Any) -> None:
            if forwards[0] == 2:
                mode.__exit__(None, None, None)
                states.append(_generator_states())

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        if len(states) == 2:
            self.collectives = bool(self.collectives) or mode.count > 0
            self.draws[training] = any(not torch.equal(a, b) for a, b in zip(*states, strict=True))


def _generator_states() -> list[torch.Tensor]:
    """The default random generators' states: the CPU's, and each device's of the accelerator in use."""
    states = [torch.get_rng_state()]
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if device is not None:
        module = torch.get_device_module(device)
        if getattr(module, "is_initialized", lambda: True)() and hasattr(module, "get_rng_state_all"):
            states += module.get_rng_state_all()
    return states


class TokenSyncHandle:
    """Takes the wrappers `skip_token_sync` put on a model's modules off again (`remove`)."""

    def __init__(self, wrapped: list[tuple[nn.Module, Callable, Callable | None]]) -> None:
        self._wrapped = wrapped
        """(module, our wrapper, the instance's own `generate` before it or None) per module."""

    def remove(self) -> None:
        for module, wrapper, previous in self._wrapped:
            if vars(module).get("generate") is not wrapper:
                wrapper.active = False  # type: ignore[attr-defined]  # someone wrapped ours: pass through
            elif previous is None:
                del module.generate
            else:
                setattr(module, "generate", previous)  # noqa: B010 (nn.Module's typing)
        self._wrapped.clear()


def skip_token_sync(root: nn.Module, kept: Callable[[], bool]) -> list[TokenSyncHandle]:
    """Wrap `generate` on every transformers generation module of `root` so that, while `kept()`
    says every FSDP2 unit of the model stays unsharded through a generation, it runs without the
    per-token all-reduce (see the module docstring). Returns the handle that takes it off; none
    where transformers is not loaded or its `generate` takes no `synced_gpus`."""
    generation = sys.modules.get("transformers.generation.utils")
    mixin = getattr(generation, "GenerationMixin", None)
    if mixin is None:
        return []  # no model here is a transformers model
    wrapped: list[tuple[nn.Module, Callable, Callable | None]] = []
    for module in root.modules():
        if not isinstance(module, mixin):
            continue
        parameters = list(inspect.signature(type(module).generate).parameters)
        if ARGUMENT not in parameters:
            continue
        position = parameters.index(ARGUMENT) - 1  # without self
        previous = vars(module).get("generate")
        wrapper = _unsynced(module, position, kept, SyncProof())
        setattr(module, "generate", wrapper)  # noqa: B010  NOTE: an instance attribute, as FSDP2's register sets
        wrapped.append((module, wrapper, previous))
    return [TokenSyncHandle(wrapped)] if wrapped else []


def _unsynced(module: nn.Module, position: int, kept: Callable[[], bool], proof: SyncProof) -> Callable:
    generate: Callable = module.generate  # type: ignore[assignment]  # nn.Module types attributes as Tensor | Module

    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if wrapper.active and ARGUMENT not in kwargs and len(args) <= position and kept():  # type: ignore[attr-defined]
            if not proof.settled(module.training):
                with proof.watching(module):  # transformers' default, once per mode
                    return generate(*args, **kwargs)
            if proof.free(module.training):
                kwargs[ARGUMENT] = False
        return generate(*args, **kwargs)

    wrapper.active = True  # type: ignore[attr-defined]
    return wrapper
