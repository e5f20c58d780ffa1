"""Uneven micro-batch counts without `grad_sync.join()`: refused, on every rank, where every rank
still meets (`EvenCounts.check` at `accelerator.wait_for_everyone()` and accelerate's save-state
pre-hook), with one line naming each rank's count and `join()`. Only a rank whose extra
micro-batches issued no collective gets there (a window's held micro-batches after its first);
any other waits inside FSDP first and the job hangs, as it does without the plugin (docs/modes.md).

The check runs on the plugin's own group (agreement.py's `ControlGroup`), so a rank that is one
micro-batch ahead, waiting in a training collective, cannot pair with it. Also `by_rank`, which
join.py's refusals share.
"""

from __future__ import annotations

from typing import Any

from accel_gradsync.runtime.core.state import Attachment


class EvenCounts:
    """The check of one `attach()`: every bound model's micro-batches since attach, summed, must be
    the same on every rank. A Trainer's ranks run equal counts and are not checked."""

    def __init__(self, state: Attachment) -> None:
        self.state = state
        self._save_hook: Any = None

    def check(self, where: str) -> None:
        """One all-reduce; where the counts differ, a `ValueError` on every rank."""
        control = self.state.control
        if self.state.trainer is not None or not self.state.bound or not control.distributed:
            return
        # grad_sync.step(n)'s evened micro-batches count as run: padding would have run them.
        totals = [b.account.total for b in self.state.bound.values()]
        count = sum(t.micro_batches + t.evened_micro_batches for t in totals)
        most, fewest = control.max([count, -count])
        if most + fewest == 0:
            return
        counts = control.gather((count, False))
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
