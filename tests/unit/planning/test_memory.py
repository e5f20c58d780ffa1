"""planning/memory.py's `RankMemory` in one process: free memory read once per run (later plans
read what the first one did), the configured free memory taking the device's place, the probe
made once; ranks' agreement is tested on 2 ranks (tests/distributed/test_modes.py)."""

from types import SimpleNamespace

import psutil
import torch

from accel_gradsync import GradSyncConfig
from accel_gradsync.planning.memory import CpuMemoryProbe, RankMemory


def test_free_memory_is_read_once_per_run(monkeypatch):
    readings = iter([5 << 30, 1 << 30])
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=next(readings)))
    memory = RankMemory(GradSyncConfig(), torch.device("cpu"))
    assert memory.free() == 5 << 30
    assert memory.free() == 5 << 30  # not the second reading: one decision per run


def test_configured_free_memory_replaces_the_device_reading(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1))
    memory = RankMemory(GradSyncConfig(sync_mode="auto", free_memory="3GiB"), torch.device("cpu"))
    assert memory.free() == 3 << 30
    assert memory.probe.capacity() == 3 << 30


def test_the_probe_is_made_once_for_the_device_or_taken_as_given():
    memory = RankMemory(GradSyncConfig(), torch.device("cpu"))
    assert isinstance(memory.probe, CpuMemoryProbe) and memory.probe is memory.probe
    given = CpuMemoryProbe(7)
    assert RankMemory(GradSyncConfig(), torch.device("cpu"), given).probe is given


def test_one_process_agrees_with_itself():
    assert RankMemory(GradSyncConfig(), torch.device("cpu")).agree_peak(10, 20) == (10, 20)
