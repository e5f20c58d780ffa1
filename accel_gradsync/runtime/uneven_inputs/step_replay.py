"""The last micro-batch of a `grad_sync.step(n)` step whose plan replays (uneven_steps.py decides
which): `LastMicroBatch` watches its backward on every rank, and on a rank below the step's largest
count holds it, records it and replays it x 0 until that rank ran the largest count.

Where the replays run: at the first clip, loop collective, optimizer step or forward without
gradients of a trained model (a metric) after the last micro-batch's backward (a clip's norm reads
the synced gradients), else where its `accumulate()` block ends. A forward with gradients there
may belong to the micro-batch (a backward per part of it), so it is recorded; one with no backward
after it is refused at the replays (its collectives ran early). The micro-batch is held like the
ones before it (hooks.py enters the window's `no_sync` for it, `hold`), its forwards recorded as
`join()` records them (join_record.py), and accelerate counts the replays on to the largest count,
so the last replay syncs: the collectives pair one for one with those of the rank that runs the
most. An optimizer step before that backward cannot wait for the replays (the other ranks wait in
the backward's collectives), so it runs, resharding nothing (`Window.keep_gathered_through_step`),
and is reported (`misordered`) for every rank to refuse at the block's end.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.core.state import Attachment
from accel_gradsync.runtime.uneven_inputs.join_record import Iteration, holds_generation_cache, replay, tensors_of


class LastMicroBatch:
    """One step's last micro-batch where some rank replays: its backward watched, its record, its
    replays. `arm` at the step's first micro-batch, `begin` at the last, `close` at the block's end."""

    def __init__(self, state: Attachment, window: Window) -> None:
        self.state = state
        self.window = window  # told when the optimizer steps before the last micro-batch's backward
        self.replays = 0  # this rank's replays, decided at the step's first micro-batch
        self.replaying = False
        self.misordered = False  # an optimizer step ran before the last micro-batch's backward
        self._shape: Any = None  # the step's StepShape, while armed
        self._pending: Iteration | None = None  # the last micro-batch, recorded to replay
        self._watching = False  # this rank's last micro-batch began and its backward is watched
        self._backed = False  # a backward reached the last micro-batch's outputs
        self._output_hooks: list = []  # on the bound models' forwards, while it is watched
        self._hold = contextlib.ExitStack()  # the last micro-batch's no_sync (hooks.py enters it)
        self._step_hook: Any = None

    def arm(self, shape: Any, replays: int) -> None:
        """The step has replays on some rank (`replays` on this one): watch its optimizer steps."""
        self._shape, self.replays = shape, replays
        self._step_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def begin(self, models: tuple) -> bool:
        """This rank's last micro-batch begins: its backward watched; True where it replays it, so
        hooks.py holds it, and its forwards are recorded from here."""
        self._watching, self._backed = True, False
        self._output_hooks = [root.register_forward_hook(self._watch_outputs) for root in self.state.bound]
        if not self.replays:
            return False
        self._pending = Iteration(models)
        return True

    def hold(self, no_sync: contextlib.AbstractContextManager) -> None:
        """Enter the window's `no_sync` of one model for the last micro-batch, until `flush`."""
        self._hold.enter_context(no_sync)

    def backward(self) -> None:
        """`accelerator.backward` (hooks.py): the recorded micro-batch backs up here too."""
        if self._pending is not None and not self.replaying:
            self._pending.backward()

    def record(self, called: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the last micro-batch this rank replays, recorded; a generation's refused
        (its cache grows in place, and the other ranks would not generate with the replays)."""
        iteration, shape = self._pending, self._shape
        if iteration is None or self.replaying:
            return
        if holds_generation_cache((args, kwargs)):
            raise ValueError(
                f"grad_sync.step({shape.micro_batches}): this rank's last micro-batch generates (a forward of "
                f"{type(called).__name__} with a KV cache, as transformers' generate runs it) and is replayed x 0 "
                f"up to the step's largest count, {shape.largest}: a generation cannot run again, and the other "
                "ranks would not generate with the replays; generate before the step's first micro-batch "
                "(packing by tokens needs the completions anyway) or use a plan that makes the counts free "
                "(deferred with keep_params_unsharded on FSDP2)."
            )
        iteration.forward(called, args, kwargs)

    def after_backward_point(self) -> None:
        """A clip or a loop collective (hooks.py): the last micro-batch's backwards are over, so
        its replays run first, where its backward ran."""
        if self._pending is not None and self._backed:
            self.flush()

    def before_forward_without_grad(self) -> None:
        """A trained model's forward without gradients begins (a metric, an evaluation, a
        generation): after the last micro-batch's backward it is no part of what the replays
        repeat, so they run first (with gradients, whatever the loop's grad mode); the forward then
        issues its collectives where the other ranks issue theirs, after their last micro-batch."""
        if self._pending is not None and self._backed:
            with torch.enable_grad():
                self.flush()

    def flush(self) -> None:
        """Replay the recorded last micro-batch x 0 up to the step's largest count: the hold ends
        (its gradients stay held), accelerate counts on to the largest, the last replay syncs."""
        iteration, shape = self._pending, self._shape
        if iteration is None or self.replaying:
            return
        self.stop()
        if iteration.forwards_after_last_backward():
            raise ValueError(
                f"grad_sync.step({shape.micro_batches}): a forward with gradients after this rank's last "
                f"micro-batch's backward, with no backward after it, in a step whose counts differ across ranks "
                f"({shape.smallest} to {shape.largest}) and whose plan replays the shorter ranks' last micro-batch: "
                "its collectives ran while the other ranks were still in their micro-batches (they wait until the "
                "launcher stops the run); run such a forward (a metric) under torch.no_grad(), or use a plan that "
                "makes the counts free (deferred with keep_params_unsharded on FSDP2)."
            )
        accelerator = self.state.accelerator
        accelerator.gradient_accumulation_steps = shape.largest
        self.replaying = True
        try:
            for _ in range(self.replays):
                for bound in self.state.bound.values():
                    bound.account.record_skipped(1, 0)
                with replay(accelerator, iteration):
                    pass
        finally:
            self.replaying = False
            accelerator.gradient_accumulation_steps = shape.micro_batches

    def stop(self) -> None:
        """Nothing more to record or replay (replayed, or an exception left `accumulate()`): the
        hold ends (the window's abort drops its gradients where it failed)."""
        self._pending, self._watching = None, False
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []
        self._hold.close()

    def close(self) -> None:
        """The block's end: disarmed."""
        self.stop()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._shape, self.replays, self.replaying, self.misordered = None, 0, False, False

    def _watch_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward of the last micro-batch: a backward through its outputs, however the loop
        calls it (`accelerator.backward`, `loss.backward()`), marks its backward done."""
        if not self._watching or self.replaying or not torch.is_grad_enabled():
            return
        for tensor in tensors_of(output):
            if tensor.requires_grad:
                tensor.register_hook(self._saw_backward)

    def _saw_backward(self, grad: Any) -> None:
        self._backed = True

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer pre-step hook: after the last micro-batch's backward, this
        rank's replays (if any) run first. Before it, the step runs (raising here would leave the
        other ranks waiting in that backward's collectives), and every rank refuses at the end."""
        if not self._watching or self.replaying:
            return
        if not self._backed:
            self.misordered = True
            self.window.keep_gathered_through_step()
            return
        self.flush()
