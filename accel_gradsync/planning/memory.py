"""Memory per rank, the input of `auto` and fractional `budget` decisions.

`free_device_memory` reads free memory (fractional budgets, residency). `auto` plans from
measurements instead, through a `MemoryProbe`: the memory a rank may use (its capacity) and the
peak in use during an optimizer step. One small interface with a device (CUDA / Ascend NPU) and a
CPU implementation, and `ScriptedMemoryProbe`, which plays a device with a given capacity and a
scripted series of peaks (tests, dry runs). Reading a probe is a host-side counter read: no device
synchronisation. Agreeing the readings over ranks is the runtime's (runtime/core/agreement.py's
`RankMemory`): planning issues no collective.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import psutil
import torch


def free_device_memory(device: torch.device) -> int:
    """Free bytes on `device`: CUDA / Ascend NPU `mem_get_info`, on CPU the available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]  # type: ignore[attr-defined]  # torch_npu adds torch.npu
    return psutil.virtual_memory().available


class MemoryProbe:
    """A rank's memory as `auto` sees it: `capacity()` bytes it may use, and `peak()` bytes in use
    at the worst moment since `reset_peak()`."""

    counts_tensor_bytes = True
    """Whether `peak()` counts what the step's tensors take, as a forecast does (a device's
    allocator); False where it counts something else (the CPU's resident-memory growth)."""

    def capacity(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError


class DeviceMemoryProbe(MemoryProbe):
    """CUDA, or Ascend NPU through torch_npu's same-named calls: the device's total memory, and
    the caching allocator's peak of allocated bytes since a reset."""

    def __init__(self, device: torch.device, capacity: int | None = None) -> None:
        self.device = device
        self.backend = getattr(torch, device.type)  # torch.cuda, or torch.npu with torch_npu
        self._capacity = capacity if capacity is not None else int(self.backend.mem_get_info(device)[1])

    def capacity(self) -> int:
        return self._capacity

    def reset_peak(self) -> None:
        self.backend.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return int(self.backend.max_memory_allocated(self.device))


class CpuMemoryProbe(MemoryProbe):
    """CPU: the RAM available when the probe was made is the capacity, and the peak is how much
    this process's resident memory grew above what it was at the reset (Linux VmHWM, reset
    through /proc/self/clear_refs, as the benchmarks measure a step). That growth is not what a
    step's tensors take (the allocator keeps freed pages; what was resident before is left out),
    so `auto` does not compare it with a forecast."""

    counts_tensor_bytes = False

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity if capacity is not None else psutil.virtual_memory().available
        self._base = _rss()

    def capacity(self) -> int:
        return self._capacity

    def reset_peak(self) -> None:
        reset_peak_rss()
        self._base = _rss()

    def peak(self) -> int:
        return max(peak_rss_bytes() - self._base, 0)


class ScriptedMemoryProbe(MemoryProbe):
    """Plays a device: a fixed capacity, and `peaks[k]` as the peak of the k-th measured step
    (the last value repeats). Each `reset_peak()` starts the next step."""

    def __init__(self, capacity: int, peaks: Sequence[int]) -> None:
        assert peaks, "a scripted probe needs at least one peak"  # invariant of the test set-up
        self._capacity, self.peaks, self.step = capacity, list(peaks), -1

    def capacity(self) -> int:
        return self._capacity

    def reset_peak(self) -> None:
        self.step += 1

    def peak(self) -> int:
        return self.peaks[min(max(self.step, 0), len(self.peaks) - 1)]


def memory_probe(device: torch.device, capacity: int | None = None) -> MemoryProbe:
    """The probe for `device`; `capacity` (the free_memory setting) replaces the device's."""
    if device.type in ("cuda", "npu"):
        return DeviceMemoryProbe(device, capacity)
    return CpuMemoryProbe(capacity)


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS counter (Linux VmHWM, through /proc/self/clear_refs) to the
    current RSS. False where that is not possible: the peak then runs from process start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (Linux VmHWM), else since process start."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
