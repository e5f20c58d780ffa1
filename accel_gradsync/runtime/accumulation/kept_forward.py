"""The windowed params of a window's last micro-batch, kept unsharded through each of its forwards.

A windowed unit stays unsharded from the window's first forward, but the last micro-batch syncs, so
`Window.end_hold` has put its flags back before that micro-batch's first forward: without this, the
forward would reshard after itself and the backward gather again. `KeptThroughForward.keep` sets
`reshard_after_forward` False on the windowed units for one forward with gradients (the adapter's
`keep_params_through_forward`), and the forward hook puts it back, so the backward reshards them as
FSDP2 does after a window. Forwards without gradients in between (a generation) keep them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel_gradsync.runtime.core.state import Attachment


class KeptThroughForward:
    """By bound model: how to put back the flags `keep` set, until its next forward with gradients ends."""

    def __init__(self, state: Attachment) -> None:
        self.state = state
        self._restore: dict[nn.Module, Callable[[], None]] = {}

    def keep(self, root: nn.Module) -> None:
        """The next forward with gradients of `root` keeps its windowed params, so its backward gathers
        nothing; the backward then reshards (reshard_after_backward is back to what it was)."""
        bound = self.state.bound[root]
        if bound.plan.windowed:
            self.put_back(root)
            self._restore[root] = bound.adapter.keep_params_through_forward(bound.plan.windowed)

    def keep_every_model(self) -> None:
        """`grad_sync.step(n)`, this rank's last micro-batch, under a plan that makes the counts
        free (hooks.py): every model's windowed params stay gathered from the micro-batch's first
        forward, one without gradients included, through its backward. A generation there then
        gathers once, as inside a held micro-batch of a rank that runs more, not once per token."""
        for root in self.state.bound:
            self.keep(root)

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the last forward with gradients is done; its windowed params reshard after
        backward again (a forward without gradients before it, a generation, keeps them)."""
        if torch.is_grad_enabled():
            self.put_back(module)

    def put_back(self, root: nn.Module) -> None:
        restore = self._restore.pop(root, None)
        if restore is not None:
            restore()

    def put_back_all(self) -> None:
        """An abort: every flag `keep` set comes back."""
        for root in list(self._restore):
            self.put_back(root)
