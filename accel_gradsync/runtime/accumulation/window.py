"""The hot path: hold the sync of a window's non-final micro-batches as planned, keep a window's
params through its last forward (`KeptThroughForward`, kept_forward.py), count every micro-batch,
drop the window's gradients when an exception ends it, and leave no unit gathered from before an
optimizer step.

`Accelerator.accumulate()` and the Trainer enter `no_sync(model)` on every micro-batch but the
last (hooks.py routes it to `Window.no_sync`); a forward pre-hook on each bound model sees every
micro-batch with gradients, the last one included. A micro-batch is what those delimit, not a
forward: further forwards before the next boundary (two towers, a policy and its no-KL pass)
belong to it. The flags are set once, at the window's first held micro-batch, and put back once
(the micro-batch that syncs, an exception, detach), because flipping them every micro-batch costs
more than the rest of this module. This runs per micro-batch: dict lookups and integer
additions; held bytes are read once per window; its only collective is `auto`'s one all-reduce
per window (replan.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.accumulation.kept_forward import KeptThroughForward
from accel_gradsync.runtime.accumulation.window_checks import (
    check_explicit_no_sync,
    warn_cannot_hold_yet,
    warn_evened_out,
    warn_if_clipped_mid_window,
    warn_if_sync_each_batch,
)
from accel_gradsync.runtime.core.fsdp2_counts import watch_fsdp2, watch_replicated_all_reduces
from accel_gradsync.runtime.core.state import Attachment, BoundModel, root_of
from accel_gradsync.runtime.generating.generation import GenerationGather
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


class Window:
    """The accumulation window in progress of every model bound to one `attach()`."""

    def __init__(self, state: Attachment, generation: GenerationGather) -> None:
        self.state = state
        self.generation = generation  # its flags sit on top of ours: released before ours change
        self._held: dict[nn.Module, tuple[Sequence[Unit], str]] = {}  # by model: (units held, how) in no_sync
        self.kept = KeptThroughForward(state)  # the last micro-batch's windowed params, through its forwards
        self._open: dict[nn.Module, bool] = {}  # by model: a micro-batch in progress, and whether it ends the step
        self._step_hook: torch.utils.hooks.RemovableHandle | None = None
        self._gathered_for_backward = False  # the next optimizer step runs before a backward: reshard nothing

    def watch(self, root: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Count `root`'s micro-batches from its forward (hooks inside DDP's wrapper) and FSDP2's
        collectives from its units' state (fsdp2_counts.py), and end every micro-batch at an
        optimizer step, after which no unit a forward left gathered stays so (one hook for every
        model, until `close`). Removing the handles returned unwatches `root` alone (a model bound
        again)."""
        bound = self.state.bound[root]
        handles = [root.register_forward_pre_hook(self.on_forward), root.register_forward_hook(self.kept.after_forward)]
        handles.extend(watch_fsdp2(bound.adapter, bound.account))
        trainer, replicated = self.state.trainer, bound.adapter.replicated
        handles.extend(watch_replicated_all_reduces(trainer, replicated, bound.account.record_replicated_all_reduce))
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_post_hook(self._after_optimizer_step)
        return handles

    def close(self) -> None:
        """Detach: remove the optimizer step hook (`watch`'s handles remove the rest)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-step hook: the micro-batch that ended the window is over. What a
        forward after its last backward left gathered (a forward with gradients for a metric, a
        skipped backward) from the models `optimizer` updates is resharded, so their next forward
        gathers the stepped parameters; after a normal window there is none. A window still
        holding keeps what it keeps, and so does a step that `keep_gathered_through_step` announced."""
        self._open.clear()
        keep, self._gathered_for_backward = self._gathered_for_backward, False
        for bound in self.state.bound.values():
            if bound.hold is None and not keep:
                bound.adapter.reshard_left_gathered(optimizer)
            bound.account.close_step()

    def keep_gathered_through_step(self) -> None:
        """The optimizer step about to run comes before the last micro-batch's backward, which
        needs what its forward gathered (`step(n)` refuses the loop at the block's end; a rank
        that replays holds that micro-batch, one that does not would gather again alone and
        misalign the next collectives): the step reshards nothing."""
        self._gathered_for_backward = True

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, inner_no_sync: Callable, discard_on_exception: bool = False) -> Iterator[None]:
        """Hold what the plan holds through one non-final micro-batch's forward and backward of
        `model` (bound before: hooks.py); the flags, set at the window's first such micro-batch,
        stay until its last forward. `inner_no_sync` is the wrapper's own (accelerate's or
        transformers'), for a model not wrapped or a wrapper deferring only at its root.
        `discard_on_exception`: an exception leaving the block discards the window (`abort`), for
        a Trainer, which has no `accumulate()` to do it and may retry (`auto_find_batch_size`)."""
        try:
            with self._micro_batch(model, inner_no_sync):
                yield
        except BaseException:
            if discard_on_exception:
                self.abort()
            raise

    @contextlib.contextmanager
    def _micro_batch(self, model: nn.Module, inner_no_sync: Callable) -> Iterator[None]:
        root = root_of(model)
        adapter = self.state.adapters.get(root)
        if adapter is None:
            with inner_no_sync(model):
                yield
            return
        bound = self.state.bound.get(root)
        if bound is None:  # nothing trainable: no gradient to hold
            yield
            return
        self._open.pop(root, None)  # a micro-batch starts here and ends when the block does
        try:
            with self._held_micro_batch(model, adapter, bound, inner_no_sync):
                yield
        finally:
            self._open.pop(root, None)

    @contextlib.contextmanager
    def _held_micro_batch(
        self, model: nn.Module, adapter: ModelAdapter, bound: BoundModel, accelerate_no_sync: Callable
    ) -> Iterator[None]:
        """`no_sync` of a bound model: its plan's held units hold through the block."""
        root = root_of(model)
        # accumulate() and the Trainer enter no_sync only on micro-batches that do not end an
        # optimizer step (sync_gradients False); with it True, the user called no_sync directly, as
        # accelerate documents for a loop without accumulate(), and that micro-batch holds too.
        if self.state.accelerator.sync_gradients and not self.state.step_largest:  # step(n)'s last: uneven_steps.py
            check_explicit_no_sync(self.state)
        self._replan(bound)
        plan = bound.plan
        if not plan.held:
            self._held[root] = ([], plan.held_sync)  # inside no_sync: this micro-batch does not end the step
            try:
                yield
            finally:
                self._held.pop(root, None)
            return
        held = plan.held
        if adapter.root_only:
            context = accelerate_no_sync(model)
        else:
            held = adapter.holdable(plan.held)
            if len(held) != len(plan.held):
                warn_cannot_hold_yet(self.state, len(plan.held) - len(held))
            self._start_hold(bound, held)
            context = contextlib.nullcontext()
        self._held[root] = (held, plan.held_sync)
        try:
            with context:
                yield
            if adapter.even_out_held_grads(held):
                warn_evened_out(self.state)
        except BaseException:
            self._end_hold(bound)  # flags back at once; accumulate()'s abort drops the gradients
            raise
        finally:
            self._held.pop(root, None)

    def _start_hold(self, bound: BoundModel, held: Sequence[Unit]) -> None:
        """Set the flags the plan holds, unless this window already holds exactly those."""
        if bound.holds(held):
            return
        self._end_hold(bound)  # a new plan (auto), or units that could not hold before now can
        self.generation.release()
        bound.start_hold(held)

    def _end_hold(self, bound: BoundModel) -> None:
        if bound.hold is not None:
            self.generation.release()  # units kept for generation put their flags back first
            bound.end_hold()

    def end_hold(self) -> None:
        """Put back every model's window flags: `accumulate()` entering the micro-batch that syncs,
        an abort, detach; every micro-batch in progress is over too."""
        self._open.clear()
        for bound in self.state.bound.values():
            self._end_hold(bound)

    def replan_all(self) -> None:
        """`auto`'s re-plan of every bound model now: `grad_sync.step(n)` asks at each step's start,
        on every rank alike, since a rank with one micro-batch in the step holds none."""
        for bound in self.state.bound.values():
            self._replan(bound)

    def _replan(self, bound: BoundModel) -> None:
        """At the first held micro-batch after an optimizer step: `auto` may change the plan."""
        m = self.state.micro_batches_per_step
        change = bound.replan(m)
        if change is not None:
            self.state.accelerator.print(change.message)
            self.state.accelerator.print(self.state.describe(bound))

    def on_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: count the micro-batch at its first forward; before each forward of a
        window's last micro-batch, keep the windowed params through it (the first one reads the
        held bytes)."""
        if not torch.is_grad_enabled():
            # Generation, evaluation, log-prob passes. A forward with gradients counts whatever the
            # module's train/eval mode: its backward reduces (or holds) all the same.
            return
        in_progress = self._open.get(module)
        if in_progress is not None:  # another forward of the micro-batch in progress
            if in_progress:  # it ends the step
                self.kept.keep(module)
            return
        state = self.state
        # Inside no_sync a micro-batch never ends the step, even outside accumulate() (sync_gradients True).
        ends_step = state.accelerator.sync_gradients and module not in self._held
        if module not in self._held and not ends_step:  # a non-final micro-batch that skipped no_sync
            warn_if_sync_each_batch(state)
        bound = state.bound[module]
        if module not in self._held:
            self._end_hold(bound)  # the window's last micro-batch (or one accelerate syncs): it syncs
        held, hold = self._held.get(module, ((), ""))
        if ends_step and bound.account.current.micro_batches and state.micro_batches_per_step == 1:
            # A loop holding micro-batches with no_sync outside accumulate(): its first window tells M.
            state.window_seen = bound.account.current.micro_batches + 1
            state.accelerator.print(state.describe(bound, state.window_seen))
        if ends_step and bound.account.current.deferred_micro_batches:
            # Held gradients only grow through a window: their bytes before its last forward are
            # its peak, read once per window instead of after every held backward.
            bound.account.record_held(bound.adapter.held_grad_bytes())
        if ends_step:
            self.kept.keep(module)
        self._open[module] = ends_step
        bound.account.record_micro_batch(
            bound.adapter.units,
            held,
            hold,
            ends_step=ends_step,
            windowed=bound.plan.windowed,
            keeps_params_when_held=bound.adapter.keeps_params_when_held,
            gathered=bound.adapter.unsharded_now(),
        )

    def on_clip(self) -> None:
        """`accelerator.clip_grad_norm_` (hooks.py): say once where one inside a held micro-batch
        clips some units' partial gradients and not the others'."""
        for root, (held, hold) in self._held.items():
            warn_if_clipped_mid_window(self.state, held, self.state.bound[root].adapter.units, hold)

    def abort(self) -> None:
        """An exception (KeyboardInterrupt included) left `accumulate()`: discard the window's
        gradients, held or not, so none leaks into the next one, and put every flag back."""
        self.kept.put_back_all()
        self.end_hold()
        for key, adapter in self.state.adapters.items():
            if adapter is not None:
                adapter.drop_held_grads()
                if key in self.state.bound:
                    adapter.reshard(self.state.bound[key].plan.windowed)  # a window's params, gathered for nothing now
        for bound in self.state.bound.values():
            bound.account.abort_step()
        self.state.warn_once(
            "abort",
            "accel_gradsync: an exception ended an accumulation window; its gradients were discarded "
            "and the next accumulate() starts a fresh window of M micro-batches.",
        )
