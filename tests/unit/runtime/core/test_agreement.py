"""runtime/core/agreement.py in one process: `RankMemory`'s free memory read once per run (later plans
read what the first one did), the configured free memory taking the device's place, the probe made
once; `ControlGroup` answering for the one rank. The ranks' agreement is tested on 2 ranks
(tests/distributed/test_modes.py), the group's being apart from training collectives in
tests/distributed/test_uneven_inputs.py (DDP, uneven counts without join())."""

from types import SimpleNamespace

import psutil
import torch

from accel_gradsync import GradSyncConfig
from accel_gradsync.planning.memory import CpuMemoryProbe
from accel_gradsync.runtime.core.agreement import ControlGroup, RankMemory


def test_free_memory_is_read_once_per_run(monkeypatch):
    readings = iter([5 << 30, 1 << 30])
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=next(readings)))
    memory = RankMemory(GradSyncConfig().resolved(), torch.device("cpu"), ControlGroup())
    assert memory.free() == 5 << 30
    assert memory.free() == 5 << 30  # not the second reading: one decision per run


def test_configured_free_memory_replaces_the_device_reading(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1))
    memory = RankMemory(
        GradSyncConfig(sync_mode="auto", free_memory="3GiB").resolved(), torch.device("cpu"), ControlGroup()
    )
    assert memory.free() == 3 << 30
    assert memory.probe.capacity() == 3 << 30


def test_the_probe_is_made_once_for_the_device_or_taken_as_given():
    memory = RankMemory(GradSyncConfig().resolved(), torch.device("cpu"), ControlGroup())
    assert isinstance(memory.probe, CpuMemoryProbe) and memory.probe is memory.probe
    given = CpuMemoryProbe(7)
    assert RankMemory(GradSyncConfig().resolved(), torch.device("cpu"), ControlGroup(), given).probe is given


def test_one_process_agrees_with_itself():
    assert RankMemory(GradSyncConfig().resolved(), torch.device("cpu"), ControlGroup()).agree_peak(10, 20) == (10, 20)


def test_one_process_control_group_answers_for_itself():
    control = ControlGroup()
    assert not control.distributed and control.world_size == 1
    assert control.max([3, -4]) == [3, -4] and control.gather("x") == ["x"] and control.broadcast(5, 0) == 5
    summed = torch.tensor([1, 2])
    assert control.all_reduce(summed, async_op=True).wait() and summed.tolist() == [1, 2]
