"""Resume with accelerate's `save_state` / `load_state` in a plain `accumulate` loop, per spec.

Each spec trains TinyNet with AdamW (and a decaying learning rate) for L micro-batches of M per
step three times: uninterrupted; again, saving after micro-batch `save_at` (a window boundary
when `save_at + 1` is a multiple of M, otherwise mid-window); and from a different seed, loading
that checkpoint and skipping the micro-batches it holds. This rank's parameter shards and
optimizer state (every tensor of its local `state_dict()`) after the last step are compared with
the uninterrupted run's, bit for bit. `--specs` is a JSON file of
`{"name", "config": GradSyncConfig kwargs, "M", "L", "save_at", "probe": {"capacity", "peaks"}}`.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import TinyNet, make_data, parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset

import accel_gradsync
from accel_gradsync.memory import ScriptedMemoryProbe

B, LR = 2, 1e-2


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model, optimizer) -> dict:
    """This rank's parameter shards and optimizer state tensors, by name."""
    out = {f"param/{i}": local(p) for i, p in enumerate(model.parameters())}
    state = optimizer.optimizer.state_dict()["state"]
    for index, entries in state.items():
        for key, value in entries.items():
            out[f"optim/{index}/{key}"] = local(value) if torch.is_tensor(value) else torch.tensor(value)
    return out


def differences(got: dict, want: dict) -> list[str]:
    """Names whose tensors are not bitwise equal (or exist on one side only)."""
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or not torch.equal(got[n], want[n])]


def train(accelerator, spec: dict, seed: int, save_to: str | None = None, load_from: str | None = None) -> dict:
    M, L, save_at = spec["M"], spec["L"], spec["save_at"]
    X, Y = make_data(L * B * accelerator.num_processes)
    accelerator.gradient_accumulation_steps = M
    set_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    probe = spec.get("probe")
    probe = ScriptedMemoryProbe(probe["capacity"], probe["peaks"]) if probe else None
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**spec["config"]), memory_probe=probe)
    out: dict = {}
    skip = 0
    if load_from is not None:
        try:
            accelerator.load_state(load_from)
        except ValueError as e:
            out["load_error"] = str(e)
            handle.detach()
            accelerator.free_memory()
            return out
        out["state_entries_after_load"] = len(optimizer.optimizer.state)
        skip = save_at + 1
        loader = accelerator.skip_first_batches(loader, skip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", accel_gradsync.GradSyncWarning)
        for k, (x, y) in enumerate(loader, start=skip):
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if save_to is not None and k == save_at:
                accelerator.save_state(save_to)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, accel_gradsync.GradSyncWarning)]
    out["snapshot"] = snapshot(model, optimizer)
    out["state_entries"] = len(optimizer.optimizer.state)
    stats = handle.stats()
    out["wrapper"] = stats["wrapper"]  # DDP binds at its first micro-batch
    out["levels"] = [stats[k] for k in ("units_windowed", "units_deferred", "units_per_micro_batch")]
    handle.detach()
    accelerator.free_memory()
    return out


def run_spec(accelerator, spec: dict, root: str) -> dict:
    directory = os.path.join(root, spec["name"])
    reference = train(accelerator, spec, seed=0)
    saved = train(accelerator, spec, seed=0, save_to=directory)
    resumed = train(accelerator, spec, seed=1, load_from=directory)  # another seed: only the load can match
    out = {
        "wrapper": reference["wrapper"],
        "state_entries": reference["state_entries"],
        "levels": reference["levels"],
        "save_warnings": saved["warnings"],
        "save_and_continue_differs": differences(saved["snapshot"], reference["snapshot"]),
        "files": sorted(os.listdir(directory)),
    }
    if "load_error" in resumed:
        out["load_error"] = resumed["load_error"]
    else:
        out["state_entries_after_load"] = resumed["state_entries_after_load"]
        out["resumed_levels"] = resumed["levels"]
        out["resume_differs"] = differences(resumed["snapshot"], reference["snapshot"])
        out["resume_max_diff"] = max(
            (
                (resumed["snapshot"][n].float() - reference["snapshot"][n].float()).abs().max().item()
                for n in reference["snapshot"]
                if n in resumed["snapshot"] and reference["snapshot"][n].numel()
            ),
            default=0.0,
        )
    return out


args = parse_args([(("--specs",), {"required": True})])
accel_gradsync.enable_cpu_fsdp()
accelerator = Accelerator(gradient_accumulation_steps=1)
specs = json.loads(Path(args.specs).read_text())
write_result(args.out, {spec["name"]: run_spec(accelerator, spec, os.path.join(args.out, "ckpt")) for spec in specs})
