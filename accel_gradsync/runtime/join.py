"""Uneven inputs: `grad_sync.join()`, a rank whose data runs out first shadows the others.

Semantics are those of DDP's `torch.distributed.algorithms.Join` with
`divide_by_initial_world_size=True`: the run ends where a run would end in which every rank that
ran out had gone on with extra micro-batches of loss x 0. Gradients are still averaged over all
ranks, so a micro-batch some ranks miss weighs less than a full one; the shards every rank owns
step with the others' at every optimizer step.

How. Inside `join()` every `accelerator.accumulate()` entry and `clip_grad_norm_` (hooks.py) issue
one all-reduce (`_poll`, slots below) before any collective of theirs; a training rank waits for
the answer only at its first (a rank that left with nothing to shadow answers that one) and reads
the others at its next poll, for refusals (`_settle`). A rank that left its loop
polls with 0 and, while any other rank trains, follows them (`_shadow`): for each micro-batch it
replays its last one (`_replay`: the same forwards of the same models, recorded by a forward
pre-hook ahead of FSDP's, inputs detached; outputs x 0; `accelerator.backward` inside
`accelerator.accumulate` of those models; then `step()` of every optimizer and scheduler accelerate
prepared, which act only where `sync_gradients`), for each clip it clips. So the plan, the window
and FSDP's all-gathers and reduce-scatters pair with the others' in every mode. When the last rank
leaves, all polls say 0 and every rank leaves together.

Trade-off: one small all-reduce per micro-batch and per clip, on uneven.py's `ControlGroup`
(gloo: no device synchronisation), and the last micro-batch's inputs kept until the next. What the
loop issues itself beyond the models' forwards and backwards, `clip_grad_norm_` and the optimizers'
steps (a loss gathered for logging) has no counterpart on a rank that left; a forward outside
`accumulate()` and `wait_for_everyone()` inside `join()` are refused on every rank instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.hooks
from torch import nn

from accel_gradsync.runtime.bind import model_name
from accel_gradsync.runtime.state import Attachment, root_of
from accel_gradsync.runtime.uneven import ControlGroup, EvenCounts, by_rank

TRAINING, CANNOT_SHADOW, FAILED, CLIPPING, MAX_NORM, NORM_TYPE = range(6)
"""The poll's slots, summed over ranks: the ranks still training, those that left with nothing to
shadow, those that stopped on an error, those about to clip gradients, and their `max_norm` and
`norm_type`."""


@dataclass
class _Forward:
    """One recorded forward of a micro-batch: the module the hook saw, its inputs, its grad mode."""

    module: nn.Module
    args: tuple
    kwargs: dict
    grad: bool


class Join:
    """The join state of one `attach()`: the record of the last micro-batch, the poll, the shadow."""

    def __init__(self, state: Attachment) -> None:
        self.state = state
        self.inside = False
        self._shadowing = False
        self._open = False  # inside an accumulate() of the loop
        self._models: tuple = ()
        self._current: list[_Forward] = []
        self._last: tuple[tuple, list[_Forward]] = ((), [])  # (accumulate()'s models, forwards)
        self._hooks: dict[nn.Module, torch.utils.hooks.RemovableHandle] = {}
        self._clip_params: list = []  # what this rank's loop clipped inside join()
        self._pending: tuple | None = None  # a training rank's last poll: (its work, its tensor)
        self.group = ControlGroup()
        self.even = EvenCounts(state, self.group)  # without join(): the counts must agree
        self.micro_batches = 0  # this rank's own inside join()

    # -- join() ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        if self.state.trainer is not None:
            raise ValueError(
                "grad_sync.join() is for a training loop of your own: a Trainer gives every rank the same "
                "number of micro-batches, so it needs none."
            )
        if self.inside:
            raise ValueError("grad_sync.join() is already active: enter it once, around the whole training loop.")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            yield  # one process: nothing to pair
            return
        accelerator = self.state.accelerator
        if accelerator.gradient_state.sync_with_dataloader and not accelerator.even_batches:
            raise ValueError(
                "grad_sync.join() with even_batches=False: accelerate ends each rank's accumulation at the end of "
                "its own prepared dataloader, so the ranks' optimizer steps would not pair; build the Accelerator "
                "with GradientAccumulationPlugin(sync_with_dataloader=False)."
            )
        self.inside, self.micro_batches = True, 0
        try:
            yield
            self._promote()
            self._shadow()
        finally:
            self._leave()

    @contextlib.contextmanager
    def micro_batch(self, models: tuple) -> Iterator[None]:
        """`accumulate(*models)` entered (hooks.py): inside `join()`, poll who still trains before
        any collective of this micro-batch, and record its forwards."""
        if not self.inside or self._shadowing:
            yield
            return
        self._promote()
        self._watch()
        self._poll(training=True, wait=not self.micro_batches)  # the first answers a rank that left empty
        self.micro_batches += 1
        self._models, self._open = models, True
        try:
            yield
        finally:
            self._open = False

    def clip(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        """`accelerator.clip_grad_norm_` (hooks.py) inside `join()`: announced in a poll, so that a
        rank that left clips too (the norm is a collective). Returns `parameters` to clip, as a list."""
        if not self.inside or self._shadowing:
            return parameters
        self._clip_params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        self._poll(training=True, clip=(float(max_norm), float(norm_type)), wait=False)
        return self._clip_params

    def refuse_inside(self, what: str) -> None:
        """A call every rank must make together (`wait_for_everyone()`) inside `join()`: refused on
        every rank, since a rank that left would never make it."""
        if self.inside and not self._shadowing:
            self._refuse(f"{what} inside grad_sync.join()", "call it after the `with grad_sync.join():` block")

    def check_even(self, where: str) -> None:
        """Without `join()`: micro-batch counts that differ are refused on every rank (uneven.py)."""
        if not self.inside:
            self.even.check(where)

    def close(self) -> None:
        """Detach: the hooks off, nothing recorded."""
        self._leave()
        self.even.close()

    # -- the protocol ----------------------------------------------------------------------------
    def _poll(self, training: bool, clip: tuple = (), failed: bool = False, wait: bool = True) -> list:
        """One all-reduce of what each rank does next, summed (`TRAINING`, ...). A training rank
        needs no answer but refusals, so after its first poll it does not wait (`wait=False`): the
        poll completes in gloo's thread while it trains on, and the next poll reads it first."""
        self._settle()
        cannot_shadow = not training and not failed and not self._last[1]
        max_norm, norm_type = clip or (0.0, 0.0)
        mine = [training, cannot_shadow, failed, bool(clip), max_norm, norm_type]
        polled = torch.tensor(mine, dtype=torch.float64)
        work = dist.all_reduce(polled, group=self.group.get(), async_op=True)
        if not wait:
            self._pending = (work, polled)
            return []
        work.wait()
        counts = polled.tolist()
        if not failed:
            self._judge(counts, training)
        return counts

    def _settle(self) -> None:
        """The training rank's last poll, answered by now: its refusals."""
        if self._pending is not None:
            (work, polled), self._pending = self._pending, None
            work.wait()
            self._judge(polled.tolist(), training=True)

    def _judge(self, counts: list, training: bool) -> None:
        """Refuse, on every rank alike, what cannot be shadowed."""
        if counts[FAILED]:
            raise ValueError("grad_sync.join(): another rank stopped inside join() with an error (see its output).")
        if counts[CANNOT_SHADOW] and counts[TRAINING]:  # a rank's first poll, which no rank leaves unanswered
            done = self.group.gather((self.micro_batches, not training))
            raise ValueError(
                f"grad_sync.join(): a rank left the loop with no micro-batch to shadow the others' with "
                f"({by_rank(done)}): give every rank at least one micro-batch inside join()."
            )
        if counts[CLIPPING] not in (0, counts[TRAINING]):
            raise ValueError(
                "grad_sync.join(): the ranks still training disagree: some clip gradients while others start a "
                "micro-batch; every rank's loop must clip at the same micro-batches."
            )

    def _refuse(self, what: str, fix: str) -> None:
        """Refuse `what` on this rank and, through the poll, on every other rank at its next one."""
        self._poll(training=False, failed=True)
        raise ValueError(f"grad_sync.join(): {what} cannot be shadowed by a rank that left the loop; {fix}.")

    def _shadow(self) -> None:
        """After this rank's loop, while any other rank trains: replay its last micro-batch x 0 for
        each of theirs, clip where they clip, and step where they step."""
        self._shadowing = True
        try:
            with contextlib.ExitStack() as replayed:
                while True:
                    counts = self._poll(training=False)
                    if counts[CLIPPING]:
                        n = counts[CLIPPING]
                        self.state.accelerator.clip_grad_norm_(
                            self._clipped(), counts[MAX_NORM] / n, counts[NORM_TYPE] / n
                        )
                        continue
                    replayed.close()  # the optimizer steps of the micro-batch before
                    if not counts[TRAINING]:
                        return
                    replayed.enter_context(self._replay())
        finally:
            self._shadowing = False

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """The last micro-batch again, in `accumulate()` of its models, its outputs x 0; on leaving,
        the steps of every optimizer and scheduler accelerate prepared (they act where sync_gradients)."""
        accelerator = self.state.accelerator
        models, forwards = self._last
        by_root = {root_of(m): m for m in models}
        with accelerator.accumulate(*models):
            outputs = []
            for f in forwards:
                with torch.set_grad_enabled(f.grad):
                    out = by_root.get(f.module, f.module)(*f.args, **f.kwargs)
                if f.grad:
                    outputs += [t for t in _tensors(out) if t.requires_grad]
            if outputs:
                accelerator.backward(torch.stack([t.float().sum() for t in outputs]).sum() * 0.0)
            yield
            for optimizer in accelerator._optimizers:
                optimizer.step()
            for scheduler in accelerator._schedulers:
                scheduler.step()
            for optimizer in accelerator._optimizers:
                optimizer.zero_grad()

    def _clipped(self) -> list:
        """What this rank clipped while it trained; else every parameter of its last micro-batch's models."""
        return self._clip_params or [p for m in self._last[0] for p in m.parameters()]

    # -- recording -------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A forward pre-hook on every model the attach has seen, ahead of FSDP's own."""
        for root, adapter in self.state.adapters.items():
            if adapter is not None and root not in self._hooks:
                self._hooks[root] = root.register_forward_pre_hook(self._record, prepend=True, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._shadowing:
            return
        if not self._open:
            self._refuse(
                f"a forward of {model_name(module)} outside accelerator.accumulate()",
                "run evaluation and generation after the `with grad_sync.join():` block",
            )
        self._current.append(_Forward(module, _detached(args), _detached(kwargs), torch.is_grad_enabled()))

    def _promote(self) -> None:
        """The micro-batch that just ended becomes the one a shadow replays."""
        if self._current:
            self._last, self._current = (self._models, self._current), []

    def _leave(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.inside, self._open, self._current, self._last, self._models = False, False, [], ((), []), ()
        self._clip_params, self._pending = [], None  # an unanswered poll is not waited for on the way out


def _detached(tree: Any) -> Any:
    """Inputs as recorded: tensors detached (no graph kept alive) in tuples, lists and dicts."""
    if torch.is_tensor(tree):
        return tree.detach()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_detached(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    return tree


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, tuples, lists, dicts (transformers' ModelOutput)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _tensors(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []
