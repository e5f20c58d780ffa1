"""Generation without transformers' per-token all-reduce where no rank's forward issues a collective.

transformers' `generate` defaults `synced_gpus` to True for a model FSDP manages (and under
DeepSpeed ZeRO-3) on more than one rank: at every decoded token each rank all-reduces whether its
sequences are done, and a rank that is done keeps running forwards until every rank is. It must
where each forward all-gathers sharded units, since every rank has to join each all-gather. Where
every FSDP2 unit of the model stays unsharded from a generation's first forward on (the window's
units, `gather_for_generation`, `gathered()`), only that first forward all-gathers, and every rank
runs it; no later forward issues a collective, so the per-token all-reduce only holds each rank to
the slowest at every token. DDP's `generate` runs none.

`skip_token_sync` wraps `generate` on each transformers `GenerationMixin` module of a bound model
(the root; a PEFT model's inner transformers model, whose `generate` is the one that decides):
when `kept()` holds at the call, `synced_gpus` left unset is passed as False; a value the caller
passes is kept. The wrapper is an instance attribute, as `register_fsdp_forward_method` sets one
(transformers' Trainer registers `generate` so); no class is touched. Removing the handle takes
the wrapper off where it is still the instance's `generate` (else whoever wrapped it after keeps
theirs, and ours passes calls through). A torch or transformers whose `generate` takes no
`synced_gpus` gets no wrapper.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

ARGUMENT = "synced_gpus"


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
        wrapper = _unsynced(module.generate, position, kept)
        setattr(module, "generate", wrapper)  # noqa: B010  NOTE: an instance attribute, as FSDP2's register sets
        wrapped.append((module, wrapper, previous))
    return [TokenSyncHandle(wrapped)] if wrapped else []


def _unsynced(generate: Callable, position: int, kept: Callable[[], bool]) -> Callable:
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if wrapper.active and ARGUMENT not in kwargs and len(args) <= position and kept():  # type: ignore[attr-defined]
            kwargs[ARGUMENT] = False
        return generate(*args, **kwargs)

    wrapper.active = True  # type: ignore[attr-defined]
    return wrapper
