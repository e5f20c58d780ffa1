"""One-GPU check of what CPU runs cannot show: `python tools/device_check.py` from the repo root
writes gpu_check.json to $OUT (or here). The CUDA memory probe `auto` plans from: its peak is about
1 GiB after a 1 GiB allocation and near 0 after the reset. FSDP2, every unit windowed, on CUDA (world
size 1, NCCL): memory after each backward stays level inside a window and drops by the unsharded fp32
params (`param_mib_fp32`) after its last one, in both steps; `flags_restored` is true.

Run it after a change to the device memory probe or to how the FSDP2 adapter holds and keeps units,
and on a new torch release (docs/performance.md, Reproduce). `--cpu` runs the FSDP2 part on gloo
without the memory readings: tests/tools/test_device_check.py does, so the package internals it
reads (`planning.memory`, `runtime.wrappers.fsdp2`, `runtime.wrappers.fsdp2_state`) cannot move
under it unnoticed."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from accel_gradsync.planning.memory import DeviceMemoryProbe
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.wrappers.fsdp2_state import sync_flags as unit_flags

CPU = "--cpu" in sys.argv[1:]
out = {"torch": torch.__version__, "device": "cpu" if CPU else torch.cuda.get_device_name()}
dev = torch.device("cpu") if CPU else torch.device("cuda", 0)
if not CPU:
    probe = DeviceMemoryProbe(dev)
    out["capacity_gib"] = probe.capacity() / 2**30
    probe.reset_peak()
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB
    del x
    out["peak_after_1gib_gib"] = probe.peak() / 2**30
    probe.reset_peak()
    y = torch.empty(2**20, dtype=torch.uint8, device=dev)
    out["peak_after_reset_mib"] = probe.peak() / 2**20
    del y

print(json.dumps(out), flush=True)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("gloo" if CPU else "nccl", rank=0, world_size=1)
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402 (after the process group, as on a GPU node)

torch.manual_seed(0)
dim, M = 256 if CPU else 4096, 4
model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)]).to(dev)
for layer in model:
    fully_shard(layer)
fully_shard(model)
adapter = FSDP2Adapter(model)
units = adapter.units
# Every unit's sync flags, read where the package reads them (FSDP2 has no getters).
sync_flags = lambda: {n: unit_flags(m) for n, m in model.named_modules() if isinstance(m, FSDPModule)}  # noqa: E731
before, mem = sync_flags(), []
x = torch.randn(8, dim, device=dev)
for _step in range(2):
    for k in range(M):
        if k == M - 1:
            restore = adapter.keep_params_through_forward(units)
            loss = model(x).square().mean()
            restore()
            loss.backward()
        else:
            with adapter.hold(units, "gradient_sync", units):
                model(x).square().mean().backward()
        if not CPU:
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated() / 2**20)
out["flags_restored"] = sync_flags() == before
out["mem_after_each_backward_mib"] = [round(m, 1) for m in mem]
out["param_mib_fp32"] = sum(p.numel() for p in model.parameters()) * 4 / 2**20
dist.destroy_process_group()
print(json.dumps(out, indent=1))
Path(os.environ.get("OUT", "."), "gpu_check.json").write_text(json.dumps(out, indent=1))
