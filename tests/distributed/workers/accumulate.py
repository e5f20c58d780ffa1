"""Train TinyNet with `accelerator.accumulate` in each sync mode, under whatever wrapper the
accelerate config gives (FSDP2, FSDP1 or DDP). Reports, per optimizer step, the real collectives
counted, the handle's stats and the largest gradient difference to a single-process,
unsharded reference over the same global batch, and what the handle counted against what ran
over the whole loop. A run can forward the model twice per micro-batch (siamese towers, a query
and a document pass), take a `state_dict()` in the middle of a window, or evaluate after every
optimizer step. With FSDP2 it also checks that every unit's sync flags come back as they were,
after a normal micro-batch and after one that raises."""

import contextlib
import copy
import json
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, full_grads, make_data, max_diff, parse_args, sync_flags, write_result
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import accel_gradsync
from accel_gradsync.planning.memory import ScriptedMemoryProbe
from testbed.collectives import KIND

LR = 0.1

# stats() keys compared with the collectives counted from outside over the training loop.
COUNTED = (
    "micro_batches",
    "optimizer_steps",
    "reduce_scatters_issued",
    "all_reduces_issued",
    "all_gathers",
    "generation_all_gathers",
)
DEFAULT_RUNS = [{"name": "per_micro_batch", "config": {}}, {"name": "deferred", "config": {"defer": True}}]

args = parse_args(
    [
        # [{"name": ..., "config": GradSyncConfig kwargs, "free_memory_by_rank": [...]}, ...]; optional per
        # run: "loop": "no_sync", "forwards": N per micro-batch, "state_dict_after": micro-batch index,
        # "eval_between": true, "abort_after", "probe", "attach_before_prepare"
        (("--runs",), {"type": json.loads, "default": DEFAULT_RUNS}),
        (("--M",), {"type": int, "default": 4}),
        (("--batches",), {"type": int, "default": 6}),
        (("--batch-size",), {"type": int, "default": 2}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
N, b = accelerator.num_processes, args.batch_size
X, Y = make_data(args.batches * b * N)


def by_kind(counts: dict[str, int]) -> Counter:
    """Collective calls by what they do (all_gathers, reduce_scatters, all_reduces), whatever function ran."""
    out: Counter = Counter()
    for name, calls in counts.items():
        out[KIND[name]] += calls
    return out


def micro_batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, forwards: int) -> torch.Tensor:
    """The loss of one micro-batch from `forwards` forwards of the model with gradients: one
    backward over all of them, as a siamese or query/document model runs."""
    return sum(F.mse_loss(model(x if i % 2 == 0 else -x), y) for i in range(forwards)) / forwards


def reference_grads(model: torch.nn.Module, forwards: int = 1) -> list[dict]:
    """Single process, unsharded: global micro-batch k is what all ranks see at step k."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out = []
    for k in range(args.batches):
        sl = slice(k * N * b, (k + 1) * N * b)
        (micro_batch_loss(ref, X[sl], Y[sl], forwards) / args.M).backward()
        if (k + 1) % args.M == 0 or k + 1 == args.batches:
            out.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            opt.step()
            opt.zero_grad()
    return out


def reshard_after_forward(model: torch.nn.Module) -> dict:
    """Each FSDP2 unit's reshard_after_forward, as FSDP2 keeps it (no public getter)."""
    from torch.distributed.fsdp import FSDPModule

    return {
        n: [g.post_forward_mesh_info is not None for g in m._get_fsdp_state()._fsdp_param_groups]
        for n, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }


def all_sharded(model: torch.nn.Module) -> bool:
    """True when no FSDP2 unit holds its unsharded params."""
    from torch.distributed.fsdp import FSDPModule

    return all(
        g.is_sharded
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    )


def abort_a_window(model, optimizer, after: int) -> dict:
    """Run `after` micro-batches of a window, then raise inside the next one, after its forward."""
    try:
        for k in range(after + 1):
            x, y = X[k * b : (k + 1) * b], Y[k * b : (k + 1) * b]
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                if k == after:
                    raise RuntimeError("micro-batch failed")
                accelerator.backward(loss)
    except RuntimeError:
        pass
    optimizer.zero_grad()
    return {"sharded_after_abort": all_sharded(model)}


def micro_batch(model, explicit_no_sync: bool, ends_step: bool):
    """`accumulate(model)`, or accelerate's documented loop without it: `no_sync(model)` around
    every micro-batch that does not end an optimizer step."""
    if not explicit_no_sync:
        return accelerator.accumulate(model)
    return contextlib.nullcontext() if ends_step else accelerator.no_sync(model)


result = {"wrapper": None, "modes": {}}
for run in args.runs:
    config = dict(run["config"])
    if "free_memory_by_rank" in run:  # ranks that disagree on free memory must still agree on a plan
        config["free_memory"] = run["free_memory_by_rank"][accelerator.process_index]
    probe = None
    if "probe" in run:  # auto on a scripted device: a capacity and each step's peak, per rank
        spec, r = run["probe"], accelerator.process_index
        capacity = spec["capacity_by_rank"][r] if "capacity_by_rank" in spec else spec["capacity"]
        probe = ScriptedMemoryProbe(capacity, spec["peaks_by_rank"][r] if "peaks_by_rank" in spec else [0])
    set_seed(0)
    model = TinyNet()
    forwards = run.get("forwards", 1)
    expected = reference_grads(model, forwards)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(X, Y), batch_size=b, shuffle=False)
    caught = warnings.catch_warnings(record=True)
    warned = caught.__enter__()
    warnings.simplefilter("always", accel_gradsync.GradSyncWarning)
    if run.get("attach_before_prepare"):  # needed for reduce_dtype: it must reach FSDP's policy
        handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config), memory_probe=probe)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config), memory_probe=probe)
    if isinstance(model, DistributedDataParallel):
        # DDP all-reduces from C++; the default hook does the same through torch.distributed.
        model.register_comm_hook(None, allreduce_hook)
    fsdp2 = handle.stats()["wrapper"] == "fsdp2"
    with torch.no_grad():  # an evaluation (or generation) pass first; FSDP2's lazy init sets the root's flags
        model(X[:b])
    flags_before = (sync_flags(model), reshard_after_forward(model)) if fsdp2 else None
    aborted = abort_a_window(model, optimizer, run["abort_after"]) if "abort_after" in run else {}
    counter.take()
    stats_before = handle.stats()
    ran = Counter()
    steps = []
    for k, (x, y) in enumerate(loader):
        ends_step = (k + 1) % args.M == 0 or k + 1 == args.batches
        with micro_batch(model, run.get("loop") == "no_sync", ends_step):
            accelerator.backward(micro_batch_loss(model, x, y, forwards))
            if k == run.get("state_dict_after"):
                model.state_dict()  # what save_state does in the middle of a window
            if ends_step:
                counts = counter.take()
                ran.update(by_kind(counts))
                with counter.paused():
                    grads = full_grads(model)
                levels = {k: v for k, v in handle.stats().items() if k.startswith("units_")}
                step = {"counts": counts, "ran": by_kind(counts), "levels": levels}
                steps.append({**step, "max_diff": max_diff(grads, expected[len(steps)])})
                optimizer.step()
                optimizer.zero_grad()
        if ends_step and run.get("eval_between"):
            with torch.no_grad():  # an evaluation between optimizer steps
                model(X[:b])
    ran.update(by_kind(counter.take()))
    caught.__exit__(None, None, None)
    stats_after = handle.stats()
    plan = handle.plan()
    result["modes"][run["name"]] = {
        "steps": steps,
        "forwards": forwards,
        "stats": stats_after,
        # Over the whole loop: the collectives that ran, by kind, and what the handle counted.
        "ran": dict(ran),
        "counted": {k: v - stats_before[k] for k, v in stats_after.items() if k in COUNTED},
        "plan": {
            "mode": plan.mode,
            "held": [u.name for u in plan.held],
            "held_sync": plan.held_sync,
            "held_bytes": plan.held_bytes(),
            "reason": plan.reason,
        },
        "units": {u.name: u.held_bytes for u in handle.units()},
        "windowed": [u.name for u in plan.windowed],
        "held_grad_bytes": plan.held_grad_bytes(),
        **({"probe": run["probe"]} if "probe" in run else {}),
        "decision": handle.describe(),
        "flags_restored": None if not fsdp2 else flags_before == (sync_flags(model), reshard_after_forward(model)),
        "sharded_after_step": all_sharded(model) if fsdp2 else None,
        **aborted,
        "warnings": [str(w.message) for w in warned if issubclass(w.category, accel_gradsync.GradSyncWarning)],
    }
    result["wrapper"] = handle.stats()["wrapper"]
    handle.detach()
    accelerator.free_memory()

if result["wrapper"] == "fsdp2":
    set_seed(0)
    model = TinyNet()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(defer=True))
    model.blocks[0].set_requires_gradient_sync(False, recurse=False)  # a user's own per-unit choice
    accelerator.gradient_accumulation_steps, accelerator.step = 2, 0  # windows of 2 from here
    flags = {"before": sync_flags(model)}
    with accelerator.accumulate(model):  # first micro-batch of a window: deferred
        flags["inside"] = sync_flags(model)
        accelerator.backward(model(X[:b]).sum())
    flags["between"] = sync_flags(model)  # the window still holds
    with accelerator.accumulate(model):  # its last micro-batch: syncs
        accelerator.backward(model(X[:b]).sum())
    flags["after"] = sync_flags(model)
    try:
        with accelerator.accumulate(model):
            flags["inside_raising"] = sync_flags(model)
            raise RuntimeError("micro-batch failed")
    except RuntimeError:
        pass
    flags["after_raise"] = sync_flags(model)
    with accelerator.accumulate(model):  # a window left mid-way, then detach
        accelerator.backward(model(X[:b]).sum())
    flags["held_at_detach"] = sync_flags(model)
    handle.detach()
    flags["after_detach"] = sync_flags(model)
    result["flags"] = flags
    # A window that keeps its params unsharded, left after its first micro-batch, then detach:
    # every parameter is FSDP2's sharded DTensor again, its full tensor readable.
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(defer=True, keep_params_unsharded=True))
    accelerator.step = 0
    with accelerator.accumulate(model):
        accelerator.backward(model(X[:b]).sum())
    handle.detach()
    result["windowed_detach"] = {
        name: [type(p).__name__, list(p.full_tensor().shape) if hasattr(p, "full_tensor") else None]
        for name, p in model.named_parameters()
    }

write_result(args.out, result)
