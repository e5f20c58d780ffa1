"""The plugin's own collectives: `ControlGroup`, a gloo group of all ranks made once per `attach()`
on every rank, on which every collective the plugin issues for itself runs: join()'s poll
(join.py), the even-count check (uneven.py), the ranks' agreement on free memory and on a step's
peak (`RankMemory`), and on a preemption signal (preemption.py).

Why a group of its own: a rank that is somewhere else (one micro-batch ahead in an uneven run)
has a training collective outstanding on the default group, a DDP gradient all-reduce or an FSDP
all-gather. On the same group our small all-reduce would pair with it: gloo then aborts the job
("op.preamble.length <= op.nbytes") or, worse, mixes the two. On a group of its own it can only
pair with its own kind; the worst left is the wait that uneven inputs cause anyway. gloo, also
under NCCL or HCCL: these collectives read host memory and never wait for the device.

`RankMemory` lives here too: what one run's binding reads of memory (free memory agreed once, the
probe made once, each step's peak agreed over ranks), the collective half of planning/memory.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from accel_gradsync.config.settings import ResolvedConfig
from accel_gradsync.planning.memory import MemoryProbe, free_device_memory, memory_probe


class ControlGroup:
    """A gloo group of every rank, made at construction on every rank (attach), destroyed by
    `close` (detach). With one process, or no process group, each method answers for this rank."""

    def __init__(self) -> None:
        self._group: Any = None
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.distributed:
            self._group = dist.new_group(backend="gloo")

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum `tensor` (on the CPU) over every rank; the work handle with `async_op`."""
        assert tensor.device.type == "cpu"  # gloo reads host memory
        if not self.distributed:
            return _Done() if async_op else None
        return dist.all_reduce(tensor, group=self._group, async_op=async_op)

    def max(self, values: Sequence[int]) -> list[int]:
        """The largest of each value over every rank (a minimum: the largest of its negation)."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def gather(self, value: Any) -> list:
        """`value` from every rank, in rank order (picklable objects)."""
        if not self.distributed:
            return [value]
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, value, group=self._group)
        return values

    def broadcast(self, value: Any, src: int) -> Any:
        """Rank `src`'s `value`, on every rank (picklable objects)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def close(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
            self.distributed = False


class _Done:
    """The work handle of an all-reduce over one process: done already."""

    def wait(self) -> bool:
        return True


class RankMemory:
    """One run's memory readings, agreed over ranks so that every rank plans the same: free memory
    (one all-reduce, at the first plan that reads it), the `MemoryProbe` (made at the first `auto`
    model) and each step's peak against the capacity (`auto`: one all-reduce per optimizer step)."""

    def __init__(
        self, settings: ResolvedConfig, device: torch.device, control: ControlGroup, probe: MemoryProbe | None = None
    ) -> None:
        self.settings = settings
        self.device = device
        self.control = control
        self._probe = probe
        self._free: int | None = None

    def free(self) -> int:
        """This rank's free memory (or the `free_memory` setting), then the minimum over all ranks,
        so every rank takes the same decision when theirs differ; read once per run: budgets and
        residency decided later read the same."""
        if self._free is None:
            free = self.settings.free_memory
            if free is None:
                free = free_device_memory(self.device)
            self._free = -self.control.max([-free])[0]
        return self._free

    @property
    def probe(self) -> MemoryProbe:
        """The probe given at construction, else `memory_probe` for the device, made once."""
        if self._probe is None:
            self._probe = memory_probe(self.device, self.settings.free_memory)
        return self._probe

    def agree_peak(self, peak: int, capacity: int) -> tuple[int, int]:
        """(the largest peak, the smallest capacity) over all ranks."""
        largest, smallest = self.control.max([peak, -capacity])
        return largest, -smallest
