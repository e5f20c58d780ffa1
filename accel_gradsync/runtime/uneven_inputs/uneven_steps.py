"""Micro-batch counts that differ across ranks and change every step: `grad_sync.step(n)`.

What it promises: a step in which each rank runs its own `n` micro-batches ends where a run ends
in which every rank ran the step's largest count, its extra micro-batches with loss x 0 (padding,
verl's `same_micro_num_in_dp`), and runs none of those where the plan lets it.

How. `step(n)` gathers every rank's `n` once per step, before any micro-batch, on the plugin's own
group (agreement.py); sets accelerate's own count for the block (`gradient_accumulation_steps = n`,
its counter restarted, so `accumulate()` syncs at this rank's n-th micro-batch); plans with the
step's largest count (`Attachment.step_largest`), `auto` re-planning every model there on every
rank alike. Then:
- a plan whose step issues the same collectives whatever its count (`costs.counts_are_free`: every
  FSDP2 unit windowed or resident, DDP held at its root): nothing more, but that a rank's last
  micro-batch keeps the windowed params from its first forward (`KeptThroughForward.keep_every_model`), so a
  generation in it gathers once, as in a longer count's held micro-batch, not once per token;
- any other plan: a rank below the largest count replays its last micro-batch x 0 until it ran
  the largest count (step_replay.py), so its collectives pair one for one with those of the rank
  that runs the most; a trained model's forward without gradients after that micro-batch's
  backward (a metric) runs them first.
The first `step(n)` of an attach prints each bound model's decision line again, saying which of
the two the plan is; every line after it (auto's plan changes, a model bound later) says it too.

Trade-off: one small collective per step (two in a step with replays); with replays, the compute
padding would cost on the ranks that replay (no more), and the last micro-batch's inputs kept until
they ran. Refused in one line before any collective: a Trainer, inside `join()`, mid-window, a
prepared DataLoader ending the window itself (`sync_with_dataloader`), a count below 1 on any rank
(every rank refuses). Refused where it is issued: in a step whose counts differ, a loop collective
(`gather`, `reduce`, ...; on FSDP a clip, whose norm is an all-reduce) between two of a rank's
micro-batches, which the ranks would issue a different number of times (a rank that issues it
after its last micro-batch does not refuse, and waits in it until the launcher stops the run the
other rank left). In a step with replays, a
forward of a bound model outside `accumulate()` between two of a rank's micro-batches (an
evaluation), for the same reason, before its collectives; and a generation (a forward with
transformers' KV cache) inside a micro-batch a rank replays, which cannot run again (a rank that
generates in a longer count's first micro-batch waits until the launcher stops the run). Refused
at the replays: a forward with gradients and no backward after the last micro-batch's backward,
whose collectives ran before the other ranks' (they wait likewise). Refused
at the block's end: a rank that ran another count than it said and, in a step with replays, an
optimizer step before the last micro-batch's backward on any rank (agreed in one more small
collective; step_replay.py sees a backward through its outputs however the loop calls it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.core.state import Attachment, root_of
from accel_gradsync.runtime.uneven_inputs.join import Join
from accel_gradsync.runtime.uneven_inputs.join_watch import ForwardWatch
from accel_gradsync.runtime.uneven_inputs.step_replay import LastMicroBatch


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What `grad_sync.step(n)` yields: the step's counts over ranks and its totals."""

    micro_batches: int
    """This rank's count, `n`."""
    largest: int
    """The largest count of any rank this step: the step as padding would run it."""
    smallest: int
    """The smallest count of any rank this step."""
    tokens: int | None = None
    """`tokens` summed over every rank (None where not given): the loss of a micro-batch summed
    over its tokens, x `world_size * n / tokens`, gives the step the gradient of the mean loss per
    token over the whole step (accelerate divides by `n`, FSDP and DDP average over ranks)."""
    samples: int | None = None
    """`samples` summed over every rank (None where not given), for a loss averaged per sample."""


class UnevenSteps:
    """The `step(n)` blocks of one `attach()`: the step's agreed counts, its plan (free or with
    replays, step_replay.py's `LastMicroBatch`), and what the ranks would run a different number
    of times, refused."""

    def __init__(self, state: Attachment, window: Window, join: Join) -> None:
        self.state = state
        self.window = window
        self.join = join
        self.shape: StepShape | None = None  # inside a step(n) block
        self._ran = 0  # this rank's micro-batches in the block
        self._uneven = False  # the step replays on some rank: every rank watches its last backward
        self._free = False  # the plan makes the counts free: nothing replayed on any rank
        self._inside = False  # inside one of the block's accumulate() blocks
        self._last = LastMicroBatch(state, window)
        self._forwards = ForwardWatch(self)

    @contextlib.contextmanager
    def step(self, n: int, tokens: int | None = None, samples: int | None = None) -> Iterator[StepShape]:
        self._refuse_here()
        shape = self._agree(n, tokens, samples)
        state, accelerator = self.state, self.state.accelerator
        if not state.per_rank_counts:  # the first step(n) of this attach: models bound later say it at bind
            state.per_rank_counts = True
            for bound in state.bound.values():
                accelerator.print(state.describe(bound, shape.largest))
        before = accelerator.gradient_accumulation_steps
        accelerator.gradient_accumulation_steps, accelerator.step = n, 0  # accumulate() syncs at this rank's n-th
        state.step_largest = shape.largest
        try:
            self.shape, self._ran = shape, 0
            yield shape
            self._last.flush()
            if self._uneven and any(state.control.gather(self._last.misordered)):
                raise ValueError(
                    "grad_sync.step(n): an optimizer step ran before the last micro-batch's backward, in a step whose "
                    "shorter ranks replay their last micro-batch x 0 after that backward; step after backward."
                )
            if self._ran != n:
                raise ValueError(
                    f"grad_sync.step({n}): this rank ran {self._ran} micro-batch{'' if self._ran == 1 else 'es'} "
                    f"inside the block; run exactly the n you pass (the other ranks pair their collectives with it)."
                )
        finally:
            self._close()
            accelerator.gradient_accumulation_steps, accelerator.step = before, 0
            state.step_largest = 0

    # -- accelerate's calls (hooks.py) -----------------------------------------------------------
    def begin(self, models: tuple) -> bool:
        """`accumulate(*models)` entered, its counter moved: True at this rank's last micro-batch
        of a step it ends with replays; hooks.py then holds it (`hold`), and its forwards are
        recorded from here."""
        if self.shape is None or self._last.replaying:
            return False
        self._ran, self._inside = self._ran + 1, True
        if self._ran == 1:
            self._plan_step(self.shape)
        last = self._ran == self.shape.micro_batches
        if last and not self._last.replays:  # counted as it ends: a step that fails evens nothing out
            for bound in self.state.bound.values():
                bound.account.record_skipped(0, self.shape.largest - self.shape.micro_batches)
        # Every rank of a step with replays watches its last backward: an optimizer step before it
        # is refused on each (the replaying rank cannot replay before it; the others would wait).
        return last and self._uneven and self._last.begin(models)

    def leave(self) -> None:
        """`accumulate()` left (hooks.py), its replays run."""
        if not self._last.replaying:
            self._inside = False

    def keeps_windowed(self) -> bool:
        """This rank's last micro-batch under a plan that makes the counts free: it keeps the
        windowed params from its first forward, as a longer count's held micro-batch does, so a
        generation in it issues what the other ranks' does (hooks.py, `KeptThroughForward.keep_every_model`)."""
        return self.shape is not None and self._free and self._ran == self.shape.micro_batches

    def hold(self, no_sync: contextlib.AbstractContextManager) -> None:
        """Enter the window's `no_sync` of one model for the last micro-batch, until it is replayed."""
        self._last.hold(no_sync)

    def backward(self) -> None:
        """`accelerator.backward` (hooks.py)."""
        self._last.backward()

    def flush(self) -> None:
        """The loop stepped outside the last micro-batch's `accumulate()` (hooks.py): its replays."""
        self._last.flush()

    def abort(self) -> None:
        """An exception left `accumulate()`: nothing to replay, the hold ends (window.abort drops it)."""
        self._last.stop()

    def loop_collective(self, name: str) -> None:
        """`accelerator.<name>()` (hooks.py: gather, reduce, ...). In a step whose counts differ,
        between two of this rank's micro-batches it is refused: the other ranks would issue it
        another number of times, and one would wait for a collective that never comes. Else the
        last micro-batch's replays run first (`after_backward_point`)."""
        self._refuse_between(
            f"accelerator.{name}()",
            "the ranks would issue it a different number of times and wait for each other; call it once per "
            "step, after the last micro-batch, or read the step's totals from step.tokens or step.samples.",
        )
        self._last.after_backward_point()

    def clip(self) -> None:
        """`accelerator.clip_grad_norm_` (hooks.py): of an FSDP model its norm is an all-reduce, so
        between two of this rank's micro-batches, in a step whose counts differ, it is refused as a
        loop collective is (DDP's is local). Else the last micro-batch's replays run first."""
        if any(adapter is not None and adapter.kind != "ddp" for adapter in self.state.adapters.values()):
            self._refuse_between(
                "accelerator.clip_grad_norm_()",
                "under FSDP its norm is an all-reduce, which the ranks would issue a different number of times, "
                "and wait for each other; clip once per step, where accelerator.sync_gradients is True.",
            )
        self._last.after_backward_point()

    def _refuse_between(self, what: str, why: str) -> None:
        shape = self.shape
        if (
            shape is not None
            and shape.largest != shape.smallest
            and 0 < self._ran < shape.micro_batches  # between two of this rank's micro-batches
            and not self._last.replaying
        ):
            raise ValueError(
                f"grad_sync.step({shape.micro_batches}): {what} after micro-batch {self._ran} of this rank's "
                f"{shape.micro_batches}, in a step whose counts differ across ranks ({shape.smallest} to "
                f"{shape.largest}): {why}"
            )

    def close(self) -> None:
        """Detach."""
        self._close()

    # -- join_watch.ForwardWatch's sink, in a step with replays ----------------------------------
    def start(self, module: nn.Module) -> None:
        """A bound model's forward begins, before its collectives: refused outside `accumulate()`
        between two of this rank's micro-batches (an evaluation), which the ranks would run a
        different number of times. Before the first or after the last (its replays ran at its
        `accumulate()`'s end), every rank runs it once. One without gradients of a trained model
        after the last micro-batch's backward runs the replays first (step_replay.py)."""
        shape = self.shape
        if shape is not None and not torch.is_grad_enabled() and root_of(module) in self.state.bound:
            self._last.before_forward_without_grad()  # a metric after the last backward: the replays first
        if shape is None or self._inside or self._last.replaying or not 0 < self._ran < shape.micro_batches:
            return
        raise ValueError(
            f"grad_sync.step({shape.micro_batches}): a forward of {type(module).__name__} outside accumulate() "
            f"after micro-batch {self._ran} of this rank's {shape.micro_batches}, in a step whose counts differ "
            f"across ranks ({shape.smallest} to {shape.largest}) and whose plan replays the shorter ranks' last "
            "micro-batch: the ranks would run it a different number of times and wait for each other; run it "
            "before the step's first micro-batch, after its last, or inside accumulate()."
        )

    def record(self, called: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward's call: recorded where this rank replays its last micro-batch."""
        self._last.record(called, args, kwargs)

    # -- inside ----------------------------------------------------------------------------------
    def _refuse_here(self) -> None:
        """What cannot run uneven counts, refused on this rank (every rank's loop is the same)."""
        where = "grad_sync.step(n)"
        if self.state.trainer is not None:
            raise ValueError(f"{where} is for a training loop of your own: a Trainer runs one count on every rank.")
        if self.join.inside:
            raise ValueError(f"{where} inside grad_sync.join(): use one or the other (join() is for the data's end).")
        if self.shape is not None:
            raise ValueError(f"{where} is already active: enter it once per optimizer step, not nested.")
        gradient_state = self.state.accelerator.gradient_state
        if gradient_state.sync_with_dataloader and gradient_state.in_dataloader:
            raise ValueError(
                f"{where} inside a loop over a prepared DataLoader with sync_with_dataloader=True: accelerate "
                "ends the window at the DataLoader's last batch whatever n says; build the Accelerator with "
                "GradientAccumulationPlugin(num_steps=..., sync_with_dataloader=False)."
            )
        done = max((b.account.current.micro_batches for b in self.state.bound.values()), default=0)
        if done:
            raise ValueError(
                f"{where} entered after {done} micro-batch{'' if done == 1 else 'es'} of an accumulation window: "
                "enter it before the step's first micro-batch and leave it after the optimizer step."
            )

    def _agree(self, n: Any, tokens: Any, samples: Any) -> StepShape:
        """Every rank's count and totals, in one collective; a bad count refused on every rank."""
        mine = (n, tokens, samples) if _count(n) else None
        counts = self.state.control.gather(mine)
        bad = [r for r, c in enumerate(counts) if c is None]
        if bad:
            raise ValueError(
                f"grad_sync.step(n): n must be an int >= 1 on every rank (this rank: {n!r}; bad on rank(s) "
                f"{', '.join(map(str, bad))}): a rank with nothing to train this step still runs one micro-batch."
            )
        ns = [c[0] for c in counts]

        def total(i: int) -> int | None:
            given = [c[i] for c in counts]
            return None if any(v is None for v in given) else int(sum(given))

        return StepShape(n, max(ns), min(ns), total(1), total(2))

    def _plan_step(self, shape: StepShape) -> None:
        """The step's first micro-batch, every model bound (hooks.py binds a DDP model here): auto
        re-plans on every rank (one with a single micro-batch holds none), and the plan says
        whether this rank replays."""
        state = self.state
        self.window.replan_all()
        free = self._free = state.counts_are_free()
        self._uneven = not free and shape.largest != shape.smallest
        for bound in state.bound.values():
            bound.account.record_uneven(shape.smallest, shape.largest)
        if self._uneven:
            self._last.arm(shape, shape.largest - shape.micro_batches)
            self._forwards.watch(self.state.adapters)

    def _close(self) -> None:
        self._last.close()
        self._forwards.close()
        self.shape, self._ran, self._uneven, self._inside, self._free = None, 0, False, False, False


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1
