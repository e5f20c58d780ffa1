"""Uneven inputs: `grad_sync.join()`, a rank whose data runs out first shadows the others.

Semantics are those of DDP's `torch.distributed.algorithms.Join` with
`divide_by_initial_world_size=True`: the run ends where a run would end in which every rank that
ran out had gone on with extra micro-batches of loss x 0. Gradients are still averaged over all
ranks, so a micro-batch some ranks miss weighs less than a full one; the shards every rank owns
step with the others' at every optimizer step, with the others' learning rates.

How. Inside `join()` every micro-batch (an `accelerator.accumulate()` entry; in a loop without it,
the first forward after an optimizer step: join_watch.py sees the loop's forwards) and every
`clip_grad_norm_`, loop collective (`gather`, `reduce`, ...: hooks.py) and forward of a trained
model without gradients after the micro-batch's backward (a metric: not recorded) issue one
all-reduce (join_poll.py) on the plugin's own group (agreement.py) before any collective of
theirs. A training rank waits for the answer only at its first and at a loop collective, and reads
the others at its next poll, for refusals. Each poll also carries which prepared optimizers the
rank stepped since its last one and with which hyperparameters (join_steps.py). A rank that left
its loop polls with 0 and, while any other rank trains, follows them (`_shadow`): per micro-batch
it replays its last one x 0 (join_record.py), clips where they clip, contributes zeros to their
loop collectives, forwards the model they forward for a metric, and steps the optimizers they
stepped, with their learning rates; it steps no scheduler (only the loop knows when). When the
last rank leaves, all polls say 0, every rank leaves together, and the ranks that shadowed take
the schedulers' states and hyperparameters of the rank that trained longest.

Trade-off: one small all-reduce per micro-batch, per clip and per loop collective, and the last
micro-batch's inputs kept until the next. Refused on every rank in one line instead of a hang:
`wait_for_everyone()`, `save_state()` and `load_state()` inside the block (a rank that left would
never make them), a forward outside `accumulate()` in a loop that uses it (and the reverse), a
generation inside a micro-batch (a forward with transformers' KV cache: a replay cannot run it
again), a step of an optimizer accelerate did not prepare, a rank with nothing to replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from accel_gradsync.runtime.core.state import Attachment, root_of
from accel_gradsync.runtime.uneven_inputs.join_poll import (
    CLIPPING,
    COLLECTIVE,
    FORWARD,
    MAX_NORM,
    NORM_TYPE,
    STEPS,
    TRAINING,
    Poll,
)
from accel_gradsync.runtime.uneven_inputs.join_record import (
    Iteration,
    forward_again,
    holds_generation_cache,
    replay,
    spec,
    zeros_like_tree,
)
from accel_gradsync.runtime.uneven_inputs.join_steps import StepReports, decode, even_out_loop_state
from accel_gradsync.runtime.uneven_inputs.join_watch import ForwardWatch
from accel_gradsync.runtime.uneven_inputs.uneven import EvenCounts
from accel_gradsync.runtime.wrappers.adapt import model_name


class Join:
    """The join state of one `attach()`: the record of the last micro-batch, the poll, the shadow."""

    def __init__(self, state: Attachment) -> None:
        self.state = state
        self.inside = False
        self._shadowing = False
        self._open = False  # inside an accumulate() of the loop
        self._style = ""  # "accumulate", or "loop" (no accumulate()): the first micro-batch's
        self._current: Iteration | None = None  # the micro-batch under way
        self._last: Iteration | None = None  # the one a shadow replays
        self._forwards = ForwardWatch(self)
        self._step_hook: Any = None
        self._clip_params: list = []  # what this rank's loop clipped inside join()
        self._clip_model: nn.Module | None = None  # the model whose parameters() it clipped, if it did
        self._in_collective = False
        self.steps = StepReports(state.accelerator)
        self._poll = Poll(state.control, self.steps)
        self.even = EvenCounts(state)  # without join(): the counts must agree
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
        if not self.state.control.distributed:
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
        self._forwards.watch(self.state.adapters)
        self._step_hook = register_optimizer_step_pre_hook(self._before_step)
        try:
            yield
            self._promote()
            self._shadow()
            even_out_loop_state(self.state.control, accelerator, self.micro_batches)
        finally:
            self._leave()

    @contextlib.contextmanager
    def micro_batch(self, models: tuple) -> Iterator[None]:
        """`accumulate(*models)` entered (hooks.py): inside `join()`, poll who still trains before
        any collective of this micro-batch, and record its forwards."""
        if not self.inside or self._shadowing:
            yield
            return
        if self._style == "loop":
            self._refuse("accelerator.accumulate() in a loop whose micro-batches ran outside it", "use it in each")
        self._style = "accumulate"
        self._begin(models)
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def backward(self) -> None:
        """`accelerator.backward` (hooks.py): the recorded micro-batch backs up here too."""
        if self.inside and not self._shadowing and self._current is not None:
            self._current.backward()

    def clip(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        """`accelerator.clip_grad_norm_` (hooks.py) inside `join()`: announced in a poll, so that a
        rank that left clips too (the norm is a collective). Returns `parameters` to clip, as a list."""
        if not self.inside or self._shadowing:
            return parameters
        clipped = [parameters] if torch.is_tensor(parameters) else list(parameters)
        ids = [id(p) for p in clipped]
        # NOTE: a model's own parameters() are read again at each shadow clip: FSDP2 swaps a unit's
        # registered parameters while it is unsharded, so a list kept from a held micro-batch goes stale.
        models = self.state.accelerator._models
        self._clip_model = next((m for m in models if [id(p) for p in m.parameters()] == ids), None)
        self._clip_params = clipped
        self._send(training=True, clip=(float(max_norm), float(norm_type)), wait=False)
        return clipped

    @contextlib.contextmanager
    def loop_collective(self, name: str, data: Any, kwargs: dict) -> Iterator[None]:
        """`accelerator.<name>(data, **kwargs)` (gather, gather_for_metrics, reduce,
        pad_across_processes; hooks.py) inside `join()`: announced in a poll; where a rank has left,
        the training ranks send it the shape, and it issues the same call with zeros."""
        if not self.inside or self._shadowing or self._in_collective:
            yield
            return
        self._in_collective = True  # gather_for_metrics calls gather: one announcement
        try:
            counts = self._send(training=True, collective=True)
            if counts[TRAINING] < self.state.control.world_size:
                self.state.control.gather((name, spec(data), kwargs))
            yield
        finally:
            self._in_collective = False

    def refuse_inside(self, what: str) -> None:
        """A call every rank must make together (`wait_for_everyone()`, `save_state()`) inside
        `join()`: refused on every rank, since a rank that left would never make it."""
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
    def _begin(self, models: tuple | None) -> None:
        """A micro-batch starts on this training rank: poll before any collective of it."""
        self._promote()
        self._forwards.watch(self.state.adapters)  # a model bound since
        self._send(training=True, wait=not self.micro_batches)  # the first answers a rank that left empty
        self.micro_batches += 1
        self._current = Iteration(models)

    def _send(self, training: bool, failed: bool = False, **what: Any) -> list:
        cannot_shadow = not training and not failed and self._last is None
        return self._poll.send(self.micro_batches, training, cannot_shadow, failed=failed, **what)

    def _refuse(self, what: str, fix: str) -> None:
        """Refuse `what` on this rank and, through the poll, on every other rank at its next one."""
        self._send(training=False, failed=True)
        raise ValueError(f"grad_sync.join(): {what} cannot be shadowed by a rank that left the loop; {fix}.")

    def _shadow(self) -> None:
        """After this rank's loop, while any other rank trains: replay its last micro-batch x 0 for
        each of theirs, clip where they clip, gather zeros where they gather, and step the
        optimizers they stepped with their hyperparameters."""
        self._shadowing = True
        stepped: dict[int, list[float]] = {}  # what the others stepped since the replay began
        accelerator = self.state.accelerator
        replaying = False
        try:
            with contextlib.ExitStack() as replayed:
                while True:
                    # Its first poll carries its own last step: the others' replays (if any) need it.
                    counts = self._send(training=False)
                    if replaying:
                        self.steps.apply(counts[STEPS:], stepped)
                    if counts[CLIPPING]:
                        n = counts[CLIPPING]
                        max_norm = decode(counts[MAX_NORM], counts[MAX_NORM + 1], n)
                        norm_type = decode(counts[NORM_TYPE], counts[NORM_TYPE + 1], n)
                        accelerator.clip_grad_norm_(self._clipped(), max_norm, norm_type)
                        continue
                    if counts[COLLECTIVE]:
                        name, tree, kwargs = next(s for s in self.state.control.gather(None) if s is not None)
                        zeros = zeros_like_tree(tree, accelerator.device) if tree is not None else []
                        getattr(accelerator, name)(zeros, **kwargs)
                        continue
                    if counts[FORWARD]:  # a metric after their backward: the same model forwarded here
                        assert self._last is not None  # else CANNOT_SHADOW refused
                        root = list(self.state.bound)[counts[FORWARD] // counts[TRAINING] - 1]
                        with torch.no_grad():
                            forward_again(self._last, root)
                        continue
                    self.steps.step(stepped)  # the others' steps in the micro-batch just replayed
                    stepped.clear()
                    replayed.close()
                    if not counts[TRAINING]:
                        return
                    assert self._last is not None  # else CANNOT_SHADOW refused
                    replayed.enter_context(replay(accelerator, self._last))
                    replaying = True
        finally:
            self._shadowing = False

    def _clipped(self) -> list:
        """What this rank clipped while it trained; else every parameter of the models it ran."""
        if self._clip_model is not None:
            return list(self._clip_model.parameters())
        if self._clip_params:
            return self._clip_params
        models = self._last.models if self._last is not None and self._last.models else self.state.accelerator._models
        return [p for m in models for p in m.parameters()]

    # -- recording (join_watch.py calls start and record) ---------------------------------------
    def start(self, module: nn.Module) -> None:
        """A forward of a watched model: outside `accumulate()`, it starts a loop's micro-batch."""
        if self._shadowing or self._open:
            return
        if self._style == "accumulate":
            self._refuse(
                f"a forward of {model_name(module)} outside accelerator.accumulate()",
                "run evaluation and generation after the `with grad_sync.join():` block",
            )
        self._style = "loop"
        if self._current is None:  # a loop without accumulate(): its micro-batch starts here
            self._begin(None)

    def record(self, called: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the micro-batch, recorded for a replay; a generation's refused (its KV cache
        grows in place, so it cannot run again, and a rank that left would replay it every time)."""
        if self._shadowing:
            return
        assert self._current is not None  # begun at accumulate() or by start
        root = root_of(called)
        if not torch.is_grad_enabled() and self._current.backed() and root in self.state.bound:
            # A metric after the micro-batch's backward: no replay repeats it; announced as a clip
            # is, before its collectives, so a rank that left forwards the same model then.
            self._send(training=True, forward=1 + list(self.state.bound).index(root), wait=False)
            return
        if holds_generation_cache((args, kwargs)):
            self._refuse(
                f"a generation inside a micro-batch ({model_name(called)} forwarded with a KV cache)",
                "generate before the `with grad_sync.join():` block or after it",
            )
        self._current.forward(called, args, kwargs)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer pre-step hook, inside `join()`: report the step in the next
        poll; in a loop without accumulate() it ends the micro-batch."""
        if not self.inside or self._shadowing:
            return
        index = self.steps.index(optimizer)
        if index is None:
            self._refuse(
                f"a step of an optimizer accelerate did not prepare ({type(optimizer).__name__})",
                "pass it through accelerator.prepare",
            )
        assert index is not None
        self.steps.record(index)
        if self._style == "loop":
            self._promote()

    def _promote(self) -> None:
        """The micro-batch that just ended becomes the one a shadow replays."""
        if self._current is not None and self._current.events:
            self._last = self._current
        self._current = None

    def _leave(self) -> None:
        self._forwards.close()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.inside, self._open, self._style, self._current, self._last = False, False, "", None, None
        self._clip_params, self._clip_model = [], None
        self._poll.clear()
        self.steps.clear()
