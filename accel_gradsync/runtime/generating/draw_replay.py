"""A rank's random draws of the generation forwards it is short, replayed after a generation run
without transformers' per-token sync (token_sync.py): under the sync a rank done first runs
forwards until every rank is done, and each draws (dropout in train mode); without it, the rank
stops at its own length. `catch_up` learns the most forwards any rank ran (one all-reduce, on the
default group, which transformers' sync uses) and runs the missing ones as `replay_token`: a
forward of one token per sequence without the cache, output dropped. That draws what a decoded
token's forward draws where the draws do not depend on the cache (PEFT's dropout masks one
token's activations, whatever it holds); `replays_faithfully` checks it for a model once, from
the generators' states around a real decoded forward. Only the default generators are read and
set (`generator_states`): the CPU's and the accelerator's in use.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from torch import nn


class ForwardsSeen:
    """The forwards of one `generate` (`see`, from a forward pre-hook): how many, the input ids of
    the second (`second`, the first decoded token) and the last token of the latest (`last`)."""

    def __init__(self) -> None:
        self.forwards = 0
        self.second: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    def see(self, args: tuple, kwargs: dict) -> None:
        self.forwards += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self.last = ids[:, -1:]
            if self.forwards == 2:
                self.second = ids


def replay_token(module: nn.Module, ids: torch.Tensor) -> None:
    """One forward of `module` on the last token of each sequence of `ids`, without the cache,
    output dropped: draws what a decoded token's forward draws where `replays_faithfully` says so."""
    with torch.no_grad():
        module(input_ids=ids[:, -1:], use_cache=False)


def replays_faithfully(
    module: nn.Module, ids: torch.Tensor, before: list[torch.Tensor], after: list[torch.Tensor]
) -> bool:
    """Whether `replay_token` of `ids`, a decoded token's forward input, from the generators' state
    `before` that forward ends in the state `after` it; the generators are put back as they are now."""
    now = generator_states()
    try:
        _set_generator_states(before)
        replay_token(module, ids)
        return same_states(generator_states(), after)
    finally:
        _set_generator_states(now)


def catch_up(module: nn.Module, seen: ForwardsSeen, device: torch.device | None) -> None:
    """After a generation without the sync: learn the most forwards any rank ran (one all-reduce,
    on the group transformers' sync uses) and replay the ones this rank would have run on under it.
    As under the sync, a rank done first replays while the others still generate: ahead of the
    answer, keeping the generators' states after its latest replays, and back to the right one
    after (from the start again, where it ran further ahead than those reach)."""
    most = torch.tensor([seen.forwards], device=device)
    work = torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, async_op=True)
    start, replayed = generator_states(), 0
    recent: deque[tuple[int, list[torch.Tensor]]] = deque(maxlen=KEPT_STATES)  # (replays, states after)
    deadline = time.monotonic() + FIRST_ANSWER_S
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(FIRST_ANSWER_S / 50)
    while not work.is_completed():
        replay_token(module, _last_token(seen))
        replayed += 1
        recent.append((replayed, generator_states()))
    work.wait()
    missing = int(most.item()) - seen.forwards
    if replayed > missing:  # ran ahead of a rank that finished sooner: back to `missing` replays
        kept = {0: start, **dict(recent)}
        replayed = missing if missing in kept else 0
        _set_generator_states(kept[replayed])
    for _ in range(missing - replayed):
        replay_token(module, _last_token(seen))


KEPT_STATES = 8
"""How many of its latest replays a rank running ahead keeps the generators' states of."""
FIRST_ANSWER_S = 0.005
"""How long a rank waits for the most forwards before it replays ahead: the last rank to finish has
the answer within an all-reduce's latency, and replays nothing only to put the generators back."""


def _last_token(seen: ForwardsSeen) -> torch.Tensor:
    if seen.last is None:
        raise RuntimeError(
            "accel-gradsync: a generation without transformers' per-token sync ran no forward with input_ids "
            "(inputs_embeds alone), so the forwards other ranks ran on cannot be replayed here; pass "
            "synced_gpus=True to generate for such a call."
        )
    return seen.last


def same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def generator_states() -> list[torch.Tensor]:
    """The default random generators' states: the CPU's, and each device's of the accelerator in use."""
    states = [torch.get_rng_state()]
    device_module = _device_generators()
    if device_module is not None:
        states += device_module.get_rng_state_all()
    return states


def _set_generator_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    device_module = _device_generators()
    if device_module is not None:
        device_module.set_rng_state_all(states[1:])


def _device_generators() -> Any:
    """The device module (torch.cuda, torch.npu, ...) whose generators `generator_states` reads, or None."""
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if device is None:
        return None
    module = torch.get_device_module(device)
    initialized = getattr(module, "is_initialized", lambda: True)()
    return module if initialized and hasattr(module, "get_rng_state_all") else None
