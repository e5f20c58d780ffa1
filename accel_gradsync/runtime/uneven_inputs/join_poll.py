"""join()'s poll (join.py): one all-reduce SUM of a few int64 on the plugin's own group
(agreement.py) per micro-batch, clip and loop collective, saying what each rank does next, and
the refusals every rank reads from it alike.

A training rank needs no answer but refusals, so after its first poll it does not wait
(`wait=False`): the all-reduce completes in gloo's thread while it trains on, and its next poll
reads the last one first (`settle`). A rank that left, or a loop collective, waits for the answer.
"""

from __future__ import annotations

import torch

from accel_gradsync.runtime.core.agreement import ControlGroup
from accel_gradsync.runtime.uneven_inputs.join_steps import StepReports, encode
from accel_gradsync.runtime.uneven_inputs.uneven import by_rank

TRAINING, CANNOT_SHADOW, FAILED, CLIPPING, COLLECTIVE, FORWARD, MAX_NORM, NORM_TYPE, STEPS = 0, 1, 2, 3, 4, 5, 6, 8, 10
"""The poll's slots, summed over ranks: the ranks still training, those that left with nothing to
shadow, those that stopped on an error, those about to clip gradients, those about to issue a
loop collective, those about to forward a trained model without gradients after the micro-batch's
backward (1 + its index among the bound models), the clip's `max_norm` and `norm_type` (two halves
each, join_steps.encode), and from `STEPS` on the optimizer steps taken since the last poll
(join_steps.StepReports)."""


class Poll:
    """The polls of one `join()` block: sent, answered, judged."""

    def __init__(self, control: ControlGroup, steps: StepReports) -> None:
        self.control = control
        self.steps = steps
        self._pending: tuple | None = None  # a training rank's last poll: (its work, its tensor)

    def send(
        self,
        micro_batches: int,
        training: bool,
        cannot_shadow: bool = False,
        clip: tuple = (),
        failed: bool = False,
        collective: bool = False,
        forward: int = 0,
        wait: bool = True,
    ) -> list:
        """This rank's poll; the sums over ranks where it waits (else `[]`). `micro_batches`: this
        rank's own so far, named in a refusal."""
        self.settle(micro_batches)
        max_norm, norm_type = clip or (0.0, 0.0)
        flags = [training, cannot_shadow, failed, bool(clip), collective, forward]
        mine = [*map(int, flags), *encode(max_norm), *encode(norm_type), *self.steps.take()]
        polled = torch.tensor(mine, dtype=torch.int64)
        work = self.control.all_reduce(polled, async_op=True)
        if not wait:
            self._pending = (work, polled)
            return []
        work.wait()
        counts = polled.tolist()
        if not failed:
            self._judge(counts, training, micro_batches)
        return counts

    def settle(self, micro_batches: int) -> None:
        """The training rank's last poll, answered by now: its refusals."""
        if self._pending is not None:
            (work, polled), self._pending = self._pending, None
            work.wait()
            self._judge(polled.tolist(), True, micro_batches)

    def clear(self) -> None:
        self._pending = None  # an unanswered poll is not waited for on the way out

    def _judge(self, counts: list, training: bool, micro_batches: int) -> None:
        """Refuse, on every rank alike, what cannot be shadowed."""
        if counts[FAILED]:
            raise ValueError("grad_sync.join(): another rank stopped inside join() with an error (see its output).")
        if counts[CANNOT_SHADOW] and counts[TRAINING]:  # a rank's first poll, which no rank leaves unanswered
            done = self.control.gather((micro_batches, not training))
            raise ValueError(
                f"grad_sync.join(): a rank left the loop with no micro-batch to shadow the others' with "
                f"({by_rank(done)}): give every rank at least one micro-batch inside join()."
            )
        n = counts[TRAINING]
        if counts[CLIPPING] not in (0, n) or counts[COLLECTIVE] not in (0, n) or counts[FORWARD] % max(n, 1):
            raise ValueError(
                "grad_sync.join(): the ranks still training disagree: some clip gradients, gather or forward a "
                "metric while others start a micro-batch; every rank's loop must do so at the same micro-batches."
            )
