"""Resume with accelerate's `save_state` / `load_state` in a plain `accumulate` loop, per spec.

Each spec trains TinyNet with AdamW (and a decaying learning rate) for L micro-batches of M per
step three times: uninterrupted; again, saving after micro-batch `save_at` (a window boundary
when `save_at + 1` is a multiple of M, otherwise mid-window); and from a different seed, loading
that checkpoint and skipping the micro-batches it holds. This rank's parameter shards and
optimizer state (every tensor of its local `state_dict()`) after the last step are compared with
the uninterrupted run's, bit for bit. `--specs` is a JSON file of
`{"name", "config": GradSyncConfig kwargs, "M", "L", "save_at", "probe": {"capacity", "by_step"},
"state_dict_type", "drop_plan", "only", "dir", "trainer"}`: `probe` plays a device whose peak
depends on the optimizer step; `state_dict_type` (FSDP) is the plugin's `fsdp_state_dict_type` for the save and
the load; `drop_plan` deletes auto's plan from the checkpoint before loading it (what a resume
that lost it would do); `only` "save" or "load" runs one half, with the checkpoint in `dir`, so a
checkpoint one launch saved can be loaded by a launch with another number of processes;
`trainer` runs workers/trainer_resume.py's Trainer instead, with the spec's `config`.

One launch runs many specs, so specs that train the same run share it: specs alike but for
`save_at`, `state_dict_type` and `drop_plan` share the uninterrupted run, and those alike but for
`save_at` also share the saving run, which saves at each of their points (each save's warnings
are told apart: those raised inside its `save_state`, plus the run's others).
"""

from __future__ import annotations

import faulthandler
import json
import os
import warnings
from collections import defaultdict
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


def _messages(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, accel_gradsync.GradSyncWarning)]


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


def use_state_dict_type(accelerator, name: str | None) -> None:
    """Save and load with FSDP's `name` state dict type from now on, configured as accelerate
    configures it from `fsdp_state_dict_type` (its default options for that type)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if name is None or plugin is None:
        return
    plugin.state_dict_config = plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(name)


def train(
    accelerator, spec: dict, seed: int, save_to: dict[int, str] | None = None, load_from: str | None = None
) -> dict:
    """Train spec's run; with `save_to`, save after each micro-batch it names, to its directory."""
    M, L, save_at = spec["M"], spec["L"], spec["save_at"]
    save_to = save_to or {}
    use_state_dict_type(accelerator, spec.get("state_dict_type"))
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
    out: dict = {"save_warnings": {}}
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
        out["load_warnings"] = _messages(loading)
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
            if k in save_to:
                before = len(caught)
                accelerator.save_state(save_to[k])
                out["save_warnings"][k] = _messages(caught[before:])
                del caught[before:]
    out["warnings"] = _messages(caught)
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
        saved = train(accelerator, spec, seed=0, save_to={spec["save_at"]: spec["dir"]})
        return {"levels": saved["levels"], "auto": saved["auto"], "files": sorted(os.listdir(spec["dir"]))}
    resumed = train(accelerator, spec, seed=1, load_from=spec["dir"])
    return {k: v for k, v in resumed.items() if k != "snapshot"}


def _key(spec: dict, *fields: str) -> str:
    """What decides a spec's training (and with `fields`, more of the spec): specs with one key share a run."""
    keys = ("config", "M", "L", "probe", *fields)
    return json.dumps({k: spec.get(k) for k in keys}, sort_keys=True)


def _resumed(resumed: dict, reference: dict) -> dict:
    if "load_error" in resumed:
        return {"load_error": resumed["load_error"]}
    want, got = reference["snapshot"], resumed["snapshot"]
    return {
        "state_entries_after_load": resumed["state_entries_after_load"],
        "resumed_levels": resumed["levels"],
        "resumed_auto": resumed["auto"],
        "resume_differs": differences(got, want),
        "resume_max_diff": max(
            ((got[n].float() - want[n].float()).abs().max().item() for n in want if n in got and want[n].numel()),
            default=0.0,
        ),
    }


def run_specs(accelerator, specs: list[dict], root: str) -> dict:
    """Every spec's result by name: one uninterrupted run per training, one saving run per
    training and way of saving, one resumed run per spec."""
    out = {spec["name"]: run_half(accelerator, spec) for spec in specs if "only" in spec}
    trainings: dict[str, list[dict]] = defaultdict(list)
    for spec in specs:
        if "only" not in spec and not spec.get("trainer"):
            trainings[_key(spec)].append(spec)
    for alike in trainings.values():
        reference = train(accelerator, alike[0], seed=0)
        savings: dict[str, list[dict]] = defaultdict(list)
        for spec in alike:
            savings[_key(spec, "state_dict_type", "drop_plan")].append(spec)
        for saving in savings.values():
            directories = {spec["save_at"]: os.path.join(root, spec["name"]) for spec in saving}
            assert len(directories) == len(saving), "two specs of one saving run save at one point"
            saved = train(accelerator, saving[0], seed=0, save_to=directories)
            for spec in saving:
                resumed = train(
                    accelerator, spec, seed=1, load_from=directories[spec["save_at"]]
                )  # only the load can match
                out[spec["name"]] = {
                    "wrapper": reference["wrapper"],
                    "state_entries": reference["state_entries"],
                    "levels": reference["levels"],
                    "auto": reference["auto"],
                    "save_warnings": saved["save_warnings"][spec["save_at"]] + saved["warnings"],
                    "save_and_continue_differs": differences(saved["snapshot"], reference["snapshot"]),
                    "files": sorted(os.listdir(directories[spec["save_at"]])),
                    **_resumed(resumed, reference),
                }
    for spec in specs:  # last: the Trainer's accelerator shares (and sets) the launch's accumulation state
        if spec.get("trainer"):
            from trainer_resume import run_trainer  # transformers' import only for launches that need it

            use_state_dict_type(accelerator, spec.get("state_dict_type"))
            out[spec["name"]] = run_trainer(spec, root, snapshot, differences, accelerator.num_processes)
    return out


args = parse_args([(("--specs",), {"required": True}), (("--deadline",), {"type": int, "default": 0})])
accel_gradsync.enable_cpu_fsdp()
if args.deadline:
    # Ranks that disagree about a checkpoint issue different collectives and wait on each other for
    # ever: past the deadline each one prints where it waits and exits, so the launch fails.
    faulthandler.dump_traceback_later(args.deadline, exit=True)
accelerator = Accelerator(gradient_accumulation_steps=1)
specs = json.loads(Path(args.specs).read_text())
write_result(args.out, run_specs(accelerator, specs, os.path.join(args.out, "ckpt")))
