"""Uneven micro-batch counts without `grad_sync.join()`: refused, on every rank, where every rank
still meets (`EvenCounts.check` at `accelerator.wait_for_everyone()` and accelerate's save-state
pre-hook), with one line naming each rank's count and `join()`. Only a rank whose extra
micro-batches issued no collective gets there (a window's held micro-batches after its first);
any other waits inside FSDP first and the job hangs, as it does without the plugin (docs/modes.md).

Also the control plane join.py's poll shares: `ControlGroup`, the group these small collectives
use (gloo, so they read host memory and never wait for the device), and `by_rank`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from accel_gradsync.runtime.state import Attachment


class ControlGroup:
    """The default group under gloo; under another backend a gloo group of all ranks, made once
    (every rank makes it at the same call: the first poll or check)."""

    def __init__(self) -> None:
        self._group: Any = None

    def get(self) -> Any:
        if dist.get_backend() == "gloo":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def gather(self, value: tuple) -> list:
        """`value` from every rank, in rank order."""
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, value, group=self.get())
        return values


class EvenCounts:
    """The check of one `attach()`: every bound model's micro-batches since attach, summed, must be
    the same on every rank. A Trainer's ranks run equal counts and are not checked."""

    def __init__(self, state: Attachment, group: ControlGroup) -> None:
        self.state = state
        self.group = group
        self._save_hook: Any = None

    def check(self, where: str) -> None:
        """One all-reduce; where the counts differ, a `ValueError` on every rank."""
        if self.state.trainer is not None or not self.state.bound or not dist.is_initialized():
            return
        count = sum(b.account.total.micro_batches for b in self.state.bound.values())
        spread = torch.tensor([count, -count], dtype=torch.int64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group.get())
        if spread[0] + spread[1] == 0:
            return
        counts = self.group.gather((count, False))
        raise ValueError(
            f"accel_gradsync: at {where} the ranks ran different numbers of micro-batches ({by_rank(counts)}): "
            "FSDP pairs every rank's collectives, so uneven inputs hang or train on without some micro-batches; "
            "wrap the training loop in `with grad_sync.join():`, or give every rank the same number."
        )

    def register(self) -> None:
        """accelerate's save-state pre-hook (it runs after the model and optimizer files are written)."""
        self._save_hook = self.state.accelerator.register_save_state_pre_hook(self._before_save)

    def close(self) -> None:
        if self._save_hook is not None:
            self._save_hook.remove()
            self._save_hook = None

    def _before_save(self, models: list, weights: list, output_dir: str) -> None:
        self.check("accelerator.save_state()")


def by_rank(counts: list) -> str:
    """`rank 0: 8 micro-batches, rank 1: 7 micro-batches (left the loop)` from each rank's (count, left)."""
    return ", ".join(
        f"rank {r}: {n} micro-batch{'' if n == 1 else 'es'}{' (left the loop)' if left else ''}"
        for r, (n, left) in enumerate(counts)
    )
