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
rank that stopped early would leave the others waiting in one; there the sync stays on. A forward
may draw random numbers (dropout active while it generates: TRL generates in train mode, and
PEFT's `lora_dropout` defaults to 0.05): under the sync the rank done first runs its forwards on
and draws with them, so a rank that stopped early would leave stock's random state, and every
dropout mask and sample after it. Where a decoded token's draws do not depend on the cache
(PEFT's dropout masks one token's activations), the rank can draw them afterwards instead: the
generation runs without the sync, one all-reduce then gives the most forwards any rank ran, and
the rank replays the ones it is short, each a forward of one token per sequence without the cache
(`catch_up`). Where they depend on it (attention dropout over the cache), the sync stays on.

Each is proven per model before it is relied on (`SyncProof`): a generation left to transformers'
default counts the c10d operations (a `TorchDispatchMode`) in its second forward, the first that
finds the units gathered, and compares the default generators' states around it; where it drew,
a replay from the state before that forward must end in the state after it. No collective and no
draw: later generations in the same mode (train or eval: dropout draws in one only) run without
the sync. No collective, draws, a faithful replay: they run without it and catch up. Else the sync
stays: for good after a collective, in that mode after a draw. The first generation with units
kept in each mode thus runs synced, and one forward of it pays the mode's per-operation cost.
Assisted generation (an assistant model, prompt lookup) decodes several tokens per forward: it
keeps the sync where forwards draw.

`skip_token_sync` wraps `generate` on each transformers `GenerationMixin` module of a bound model
(the root; a PEFT model's inner transformers model, whose `generate` is the one that decides):
when `kept()` holds at the call and the module is proven free of collectives (and of draws, or
their replay faithful), `synced_gpus` left unset is passed as False; a value the caller passes is
kept. The wrapper is an instance attribute, as `register_fsdp_forward_method` sets one
(transformers' Trainer registers `generate` so); no class is touched. Removing the handle takes the
wrapper off where it is still the instance's `generate` (else whoever wrapped it after keeps
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

from accel_gradsync.runtime.generating.draw_replay import (
    ForwardsSeen,
    catch_up,
    generator_states,
    replays_faithfully,
    same_states,
)

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
    (`collectives`, for good), draw no random number (`draws`, per train or eval mode), and where
    they draw, whether a one-token forward without the cache draws the same (`replays`, per mode):
    each unknown until a generation with two forwards or more in that mode was watched (`watching`)."""

    def __init__(self) -> None:
        self.collectives: bool | None = None
        self.draws: dict[bool, bool] = {}  # by the module's `training`
        self.replays: dict[bool, bool] = {}  # by the module's `training`, where it draws

    def settled(self, training: bool) -> bool:
        return self.collectives is True or (self.collectives is not None and training in self.draws)

    def free(self, training: bool) -> bool:
        return self.collectives is False and self.draws.get(training) is False

    def replayable(self, training: bool) -> bool:
        """Free of collectives, drawing, and a replayed forward draws as a decoded token's does."""
        return self.collectives is False and self.draws.get(training) is True and self.replays.get(training) is True

    @contextlib.contextmanager
    def watching(self, module: nn.Module) -> Iterator[None]:
        """One `generate` of `module` with transformers' sync: count the collectives of its second
        forward (the first gathers the units), see whether it drew, and settle both; where it drew,
        replay that forward from the state before it and see whether it ends in the state after."""
        seen, mode, states = ForwardsSeen(), _CollectiveCount(), []
        training = module.training

        def before(_: nn.Module, args: Any, kwargs: dict) -> None:
            seen.see(args, kwargs)
            if seen.forwards == 2:
                states.append(generator_states())
                mode.__enter__()

        def after(_: nn.Module, args: Any, output: Any) -> None:
            if seen.forwards == 2 and len(states) == 1:
                mode.__exit__(None, None, None)
                states.append(generator_states())

        handles = [
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        if len(states) == 2:
            self.collectives = bool(self.collectives) or mode.count > 0
            self.draws[training] = not same_states(*states)
            if self.draws[training] and not self.collectives and seen.second is not None:
                self.replays[training] = replays_faithfully(module, seen.second, *states)


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
            elif proof.replayable(module.training) and _decodes_token_by_token(module, kwargs) and _ranks() > 1:
                return _generate_then_catch_up(module, generate, args, kwargs)
        return generate(*args, **kwargs)

    wrapper.active = True  # type: ignore[attr-defined]
    return wrapper


def _generate_then_catch_up(module: nn.Module, generate: Callable, args: tuple, kwargs: dict) -> Any:
    """`generate` without the sync, then `catch_up`: each rank's random state ends as under it."""
    seen, device = ForwardsSeen(), next((p.device for p in module.parameters()), None)
    handle = module.register_forward_pre_hook(lambda _, a, k: seen.see(a, k), with_kwargs=True)
    try:
        out = generate(*args, **{**kwargs, ARGUMENT: False})
    finally:
        handle.remove()
    catch_up(module, seen, device)
    return out


ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate")
"""What makes `generate` decode more than one token per forward, or run a loop of its own: a replay
of one token is not what its forwards draw, so the sync stays."""


def _decodes_token_by_token(module: nn.Module, kwargs: dict) -> bool:
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    return not any(kwargs.get(name) is not None or getattr(config, name, None) is not None for name in ASSISTED)


def _ranks() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
