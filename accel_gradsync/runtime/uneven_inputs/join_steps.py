"""What a rank that left a `join()` loop (join.py) must know of the others' optimizer steps, so that
its shards step with theirs: which prepared optimizers stepped, with which hyperparameters (the
learning rate a scheduler set, a momentum or `betas` a cyclic one set), carried in join's poll; and,
when every rank has left, the schedulers and hyperparameters where the longest-running rank's loop
left them.

Why carry them: a shadowing rank does not run the loop, so it cannot step the loop's schedulers
(prepared or not, per step or per epoch: only the loop knows when); it sets each param group's
hyperparameters to what the training ranks stepped with, then steps. Why the garbage collector:
torch keeps no list of an optimizer's schedulers, and one the loop did not prepare is found only
as an object that refers to the optimizer; it is read once, when the block ends.

The poll is an all-reduce SUM of int64 (join.py). A float carried there is split into the two
32-bit halves of its float64 bits (`encode`): every reporting rank sends the same halves, so their
sum divided by the number of reporters is exact, bit for bit, where averaging floats would round.
"""

from __future__ import annotations

import gc
import struct
from typing import Any

import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import LRScheduler

from accel_gradsync.runtime.core.agreement import ControlGroup


def encode(value: float) -> list[int]:
    """`value`'s float64 bits as two non-negative int64 halves (sum them over ranks, then `decode`)."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", value))
    return [bits >> 32, bits & 0xFFFFFFFF]


def decode(high: int, low: int, reporters: int) -> float:
    """The float `reporters` ranks each sent as `encode`'s halves, from their sums."""
    bits = ((high // reporters) << 32) | (low // reporters)
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _hyperparameters(group: dict) -> list[tuple[str, int]]:
    """(key, how many numbers) of each numeric hyperparameter of a param group, in key order:
    numbers, tuples of numbers (`betas`), one-element tensors (a tensor learning rate). The
    same on every rank (the same optimizer built the same way)."""
    out = []
    for key in sorted(group):
        value = group[key]
        if key == "params" or isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1):
            out.append((key, 1))
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) for v in value):
            out.append((key, len(value)))
    return out


def _read(group: dict) -> list[float]:
    values: list[float] = []
    for key, _ in _hyperparameters(group):
        value = group[key]
        values += [float(v) for v in value] if isinstance(value, (tuple, list)) else [float(value)]
    return values


def _write(group: dict, values: list[float]) -> None:
    at = 0
    for key, n in _hyperparameters(group):
        value, taken = group[key], values[at : at + n]
        at += n
        if torch.is_tensor(value):
            value.fill_(taken[0])
        elif isinstance(value, (tuple, list)):
            group[key] = type(value)(type(v)(t) for v, t in zip(value, taken, strict=True))
        else:
            group[key] = type(value)(taken[0])


class StepReports:
    """The optimizer steps a training rank took since its last poll (`record`, from torch's global
    pre-step hook), laid out for the poll (`take`), and read back by a shadowing rank (`apply`).
    Per prepared optimizer: how many ranks stepped it, then each hyperparameter's two halves."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self._stepped: dict[int, list[float]] = {}  # by prepared optimizer: its values at the step

    def _optimizers(self) -> list[Any]:
        return list(self.accelerator._optimizers)  # NOTE: accelerate lists what it prepared only here

    def index(self, optimizer: Any) -> int | None:
        """The position among the prepared optimizers of the torch optimizer `optimizer`, or None."""
        return next((i for i, o in enumerate(self._optimizers()) if o.optimizer is optimizer), None)

    def record(self, index: int) -> None:
        optimizer = self._optimizers()[index].optimizer
        self._stepped[index] = [v for group in optimizer.param_groups for v in _read(group)]

    def take(self) -> list[int]:
        """This rank's share of the poll, then forget it: zeros where no optimizer stepped."""
        out: list[int] = []
        for i, o in enumerate(self._optimizers()):
            values = self._stepped.get(i)
            width = sum(n for group in o.optimizer.param_groups for _, n in _hyperparameters(group))
            out += [1] + [h for v in values for h in encode(v)] if values is not None else [0] * (1 + 2 * width)
        self._stepped.clear()
        return out

    def clear(self) -> None:
        self._stepped.clear()

    def apply(self, summed: list[int], into: dict[int, list[float]]) -> None:
        """The poll's share summed over ranks: for each optimizer some rank stepped, the values it
        stepped with, into `into` (a later poll's replace an earlier's)."""
        at = 0
        for i, o in enumerate(self._optimizers()):
            width = sum(n for group in o.optimizer.param_groups for _, n in _hyperparameters(group))
            reporters, halves = summed[at], summed[at + 1 : at + 1 + 2 * width]
            at += 1 + 2 * width
            if reporters:
                into[i] = [decode(halves[2 * k], halves[2 * k + 1], reporters) for k in range(width)]

    def step(self, stepped: dict[int, list[float]]) -> None:
        """A shadowing rank: step each optimizer the others stepped, with their hyperparameters."""
        optimizers = self._optimizers()
        for i, values in stepped.items():
            optimizer = optimizers[i]
            at = 0
            for group in optimizer.optimizer.param_groups:
                n = sum(width for _, width in _hyperparameters(group))
                _write(group, values[at : at + n])
                at += n
            optimizer.step()
            optimizer.zero_grad()


def schedulers_of(optimizers: list[Any]) -> list[LRScheduler]:
    """Every learning-rate scheduler of the torch `optimizers`, prepared or not, in a fixed order
    (by optimizer, then class name, then the order the collector lists them)."""
    found: dict[int, tuple[int, str, LRScheduler]] = {}
    for i, optimizer in enumerate(optimizers):
        for referrer in gc.get_referrers(optimizer):
            owners = [referrer] if isinstance(referrer, LRScheduler) else []
            if isinstance(referrer, dict):  # an instance's __dict__ (Python < 3.11 lists those)
                owners = [o for o in gc.get_referrers(referrer) if isinstance(o, LRScheduler) and vars(o) is referrer]
            for scheduler in owners:
                if scheduler.optimizer is optimizer:
                    found.setdefault(id(scheduler), (i, type(scheduler).__qualname__, scheduler))
    return [s for _, _, s in sorted(found.values(), key=lambda f: f[:2])]


def loop_state(accelerator: Accelerator) -> dict:
    """What `adopt_loop_state` sets on another rank: every prepared optimizer's param groups less
    their parameters, and every scheduler's state."""
    optimizers = [o.optimizer for o in accelerator._optimizers]
    return {
        "groups": [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers_of(optimizers)],
    }


def adopt_loop_state(accelerator: Accelerator, state: dict) -> None:
    """Take the optimizers' hyperparameters and the schedulers' states `loop_state` read elsewhere."""
    optimizers = [o.optimizer for o in accelerator._optimizers]
    for optimizer, groups in zip(optimizers, state["groups"], strict=True):
        for group, values in zip(optimizer.param_groups, groups, strict=True):
            group.update(values)
    schedulers = schedulers_of(optimizers)
    if len(schedulers) != len(state["schedulers"]):
        raise ValueError(
            f"grad_sync.join(): the ranks' optimizers have different numbers of learning-rate schedulers "
            f"({len(schedulers)} here, {len(state['schedulers'])} on the rank that trained longest); build the "
            "same schedulers on every rank."
        )
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)


def even_out_loop_state(control: ControlGroup, accelerator: Accelerator, micro_batches: int) -> None:
    """Every rank has left `join()`: the ranks that shadowed (fewer `micro_batches` of their own)
    take the schedulers' states and the optimizers' hyperparameters from a rank that trained
    longest (its loop stepped them)."""
    counts = control.gather(micro_batches)
    if len(set(counts)) == 1:
        return
    src = counts.index(max(counts))
    state = control.broadcast(loop_state(accelerator) if micro_batches == max(counts) else None, src)
    if micro_batches < max(counts):
        adopt_loop_state(accelerator, state)
