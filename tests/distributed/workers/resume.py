"""Resume with accelerate's `save_state` / `load_state` in a plain `accumulate` loop, per spec.

Each spec trains TinyNet with AdamW (and a decaying learning rate) for L micro-batches of M per
step three times: uninterrupted; again, saving after micro-batch `save_at` (a window boundary
when `save_at + 1` is a multiple of M, otherwise mid-window); and from a different seed, loading
that checkpoint and skipping the micro-batches it holds. This rank's parameter shards and
optimizer state (every tensor of its local `state_dict()`) after the last step are compared with
the uninterrupted run's, bit for bit. `--specs` is a JSON file of
`{"name", "config": GradSyncConfig kwargs, "M", "L", "save_at", "probe": {"capacity", "by_step"},
"drop_plan", "only", "dir"}`: `probe` plays a device whose peak depends on the optimizer step;
`drop_plan` deletes auto's plan from the checkpoint before loading it (what a resume that lost it
would do); `only` "save" or "load" runs one half, with the checkpoint in `dir`, so a checkpoint
one launch saved can be loaded by a launch with another number of processes.
"""

from __future__ import annotations

import faulthandler
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
from accel_gradsync.planning.memory import MemoryProbe

B, LR = 2, 1e-2


class StepPeaks(MemoryProbe):
    """Plays a device whose peak depends on the optimizer step, as a real one's does (longer
    sequences, more activations): every micro-batch of step s peaks at `by_step[s]` (the last
    value repeats). A resumed process plays the steps it runs, not the ones before its checkpoint."""

    def __init__(self, capacity: int, by_step: list[int], M: int) -> None:
        self._capacity, self.by_step, self.M, self._peak = capacity, by_step, M, 0

    def ran(self, k: int) -> None:
        """Micro-batch `k` (counted from the start of training) has run."""
        self._peak = max(self._peak, self.by_step[min(k // self.M, len(self.by_step) - 1)])

    def capacity(self) -> int:
        return self._capacity

    def reset_peak(self) -> None:
        self._peak = 0

    def peak(self) -> int:
        return self._peak


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
    probe = StepPeaks(probe["capacity"], probe["by_step"], M) if probe else None
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**spec["config"]), memory_probe=probe)
    out: dict = {}
    skip = 0
    if load_from is not None:
        if spec.get("drop_plan") and accelerator.is_main_process:
            for name in os.listdir(load_from):
                if name.startswith("accel_gradsync_plan"):
                    os.remove(os.path.join(load_from, name))
        accelerator.wait_for_everyone()
        try:
            with warnings.catch_warnings(record=True) as loading:
                warnings.simplefilter("always", accel_gradsync.GradSyncWarning)
                accelerator.load_state(load_from)
        except ValueError as e:
            out["load_error"] = str(e)
            handle.detach()
            accelerator.free_memory()
            return out
        out["load_warnings"] = [
            str(w.message) for w in loading if issubclass(w.category, accel_gradsync.GradSyncWarning)
        ]
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
            if probe is not None:
                probe.ran(k)
            if save_to is not None and k == save_at:
                accelerator.save_state(save_to)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, accel_gradsync.GradSyncWarning)]
    out["snapshot"] = snapshot(model, optimizer)
    out["state_entries"] = len(optimizer.optimizer.state)
    stats = handle.stats()
    out["wrapper"] = stats["wrapper"]  # DDP binds at its first micro-batch
    out["levels"] = [stats[k] for k in ("units_windowed", "units_deferred", "units_per_micro_batch")]
    out["auto"] = {k: stats[k] for k in ("measured_peaks", "plan_changes") if k in stats}
    handle.detach()
    accelerator.free_memory()
    return out


def run_half(accelerator, spec: dict) -> dict:
    """One launch saves a checkpoint to `spec["dir"]`; another, maybe on more processes, loads it."""
    if spec["only"] == "save":
        saved = train(accelerator, spec, seed=0, save_to=spec["dir"])
        return {"levels": saved["levels"], "auto": saved["auto"], "files": sorted(os.listdir(spec["dir"]))}
    resumed = train(accelerator, spec, seed=1, load_from=spec["dir"])
    return {k: v for k, v in resumed.items() if k != "snapshot"}


def run_spec(accelerator, spec: dict, root: str) -> dict:
    if "only" in spec:
        return run_half(accelerator, spec)
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
        out["resumed_auto"], out["auto"] = resumed["auto"], reference["auto"]
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


args = parse_args([(("--specs",), {"required": True}), (("--deadline",), {"type": int, "default": 0})])
accel_gradsync.enable_cpu_fsdp()
if args.deadline:
    # Ranks that disagree about a checkpoint issue different collectives and wait on each other for
    # ever: past the deadline each one prints where it waits and exits, so the launch fails.
    faulthandler.dump_traceback_later(args.deadline, exit=True)
accelerator = Accelerator(gradient_accumulation_steps=1)
specs = json.loads(Path(args.specs).read_text())
write_result(args.out, {spec["name"]: run_spec(accelerator, spec, os.path.join(args.out, "ckpt")) for spec in specs})
