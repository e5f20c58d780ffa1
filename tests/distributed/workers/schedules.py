"""Run one training *schedule* on the launched ranks and on a single-process reference, and
report what differed. Shared by the reliability and property workers.

A schedule is a JSON dict:
    M, L (micro-batches per rank per epoch), epochs, config (GradSyncConfig kwargs),
    M_from: [[window, M]] (the loop sets `gradient_accumulation_steps` to M before that window),
    extra_forward: true or "no_grad" (a forward, with gradients or without, and no backward after each
        window's last backward),
    clip_every: bool (`accelerator.clip_grad_norm_` after every backward, not only the step's),
    other_step: bool (another model's optimizer steps between the forward and backward of each
        window's last micro-batch),
    backwards: "split" (a backward per half of the micro-batch, each after its own forward, as a
        multi-task loop does) | "retain" (one forward, its loss in two halves, each backward on its
        own, the first with `retain_graph=True`); the gradients are the one backward's,
    eval_mid: bool (a forward without gradients after each held micro-batch's backward),
    log_every: bool (the loss averaged over ranks, `accelerator.reduce`, after every backward),
    model: "tiny" | "cond" | "frozen", route (CondNet routing rule, see ROUTES),
    raises: [[epoch, k, kind]] with kind "forward" | "after_backward" | "keyboard" | "skip" (the loop's
        loss guard `continue`s before backward and step: no exception, the window goes on),
    param_dtype: "bf16" (FSDP2 MixedPrecisionPolicy(param_dtype=bf16)) or absent,
    attach_before_prepare: bool (needed for reduce_dtype),
    zero_grad_on_abort: bool (default True: the user's handler calls `model.zero_grad()`).

The semantics the reference implements: a micro-batch that raises aborts
its accumulation window; the user's handler calls `model.zero_grad()`; the next window starts
fresh (M micro-batches, syncing on the last); the last micro-batch of the dataloader always
syncs. Every micro-batch's loss is scaled by 1/M, as `accelerator.backward` does.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from common import DIM, Block, TinyNet, full_grads, make_data, sync_flags
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel_gradsync
from accel_gradsync.runtime.wrappers.adapt import adapt_model

LR = 0.1
BATCH = 2
INJECTED = "injected failure"


class Experts(Block):
    """One FSDP unit holding two parameter sets; a route picks which of them run. A `Block`
    subclass, so the test configs' `fsdp_transformer_layer_cls_to_wrap: Block` wraps it."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x, experts: str):
        out = x
        if "a" in experts:
            out = out + torch.tanh(self.a(x))
        if "b" in experts:
            out = out + torch.tanh(self.b(x))
        return out


class CondNet(nn.Module):
    """Conditional computation: blocks.0 always runs; blocks.1 (its own unit) only when routed;
    `experts` (one unit) runs expert a and/or b; the head belongs to the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.experts = Experts()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, experts: str = "ab", run_block: bool = True):
        x = self.blocks[0](x)
        if run_block:
            x = self.blocks[1](x)
        x = self.experts(x, experts)
        return self.head(x).squeeze(-1)


def route(name: str, pos: dict) -> dict:
    """CondNet kwargs for one micro-batch: c = its position in the window, final = it ends the step."""
    c, final, w = pos["c"], pos["final"], pos["window"]
    if name == "alternate":  # expert b gets no gradient on odd micro-batches
        return {"experts": "ab" if c % 2 == 0 else "a"}
    if name == "only_final":  # expert b's first gradient of the step arrives on the final micro-batch
        return {"experts": "ab" if final else "a"}
    if name == "block_only_final":  # a whole unit runs only on the final micro-batch
        return {"run_block": final}
    if name == "skip_final":  # a unit runs on earlier micro-batches but not on the final one
        return {"run_block": not final}
    if name == "skip_window":  # a unit never runs during every other step
        return {"run_block": w % 2 == 0}
    return {}


ROUTES = ("alternate", "only_final", "block_only_final", "skip_final", "skip_window")


def positions(spec: dict) -> list[dict]:
    """Every micro-batch of the schedule in order, with its place in the window it belongs to."""
    L, raises = spec["L"], {(e, k): kind for e, k, kind in spec.get("raises", [])}
    out, window = [], 0
    for epoch in range(spec.get("epochs", 1)):
        c = 0
        for k in range(L):
            kind, M = raises.get((epoch, k)), window_M(spec, window)
            final = c + 1 == M or k == L - 1
            out.append({"epoch": epoch, "k": k, "c": c, "final": final, "window": window, "raise": kind, "M": M})
            if (kind is not None and kind != "skip") or final:
                c, window = 0, window + 1
            else:
                c += 1
    return out


def window_M(spec: dict, window: int) -> int:
    """M of the schedule's `window`-th window: `M`, or the last `[from_window, M]` of `M_from` that
    has begun (the user sets `accelerator.gradient_accumulation_steps` between optimizer steps)."""
    return next((M for start, M in reversed(spec.get("M_from", [])) if window >= start), spec["M"])


def build_model(spec: dict) -> nn.Module:
    set_seed(spec.get("seed", 0))
    model = CondNet() if spec.get("model") == "cond" else TinyNet()
    if spec.get("model") == "frozen":
        model.blocks[0].requires_grad_(False)
    return model


def reference_steps(model: nn.Module, spec: dict, X, Y, N: int) -> list[dict]:
    """Single process, unsharded, fp32: the gradients of every optimizer step."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    steps = []
    for pos in positions(spec):
        sl = slice(pos["k"] * N * BATCH, (pos["k"] + 1) * N * BATCH)
        if pos["raise"] == "forward":
            ref.zero_grad()
            continue
        if pos["raise"] == "skip":  # the loop's `continue`: no backward, no step; the window goes on
            continue
        out = ref(X[sl], **route(spec.get("route", ""), pos)) if spec.get("model") == "cond" else ref(X[sl])
        (F.mse_loss(out, Y[sl]) / pos["M"]).backward()
        if pos["raise"] is not None:
            ref.zero_grad()
            continue
        if pos["final"]:
            steps.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    return steps


def compare(got: dict, want: dict) -> dict:
    """Largest absolute difference and relative error over all parameters; a gradient missing on
    one side counts as zeros (a lost or invented gradient shows up as a difference)."""
    names = sorted(set(got) | set(want))
    diff2 = ref2 = 0.0
    worst = 0.0
    for n in names:
        a = got[n].float() if n in got else torch.zeros_like(want[n])
        b = want[n].float() if n in want else torch.zeros_like(got[n].float())
        worst = max(worst, (a - b).abs().max().item())
        diff2 += (a - b).pow(2).sum().item()
        ref2 += b.pow(2).sum().item()
    return {
        "max_diff": worst,
        "rel_err": (diff2**0.5) / max(ref2**0.5, 1e-12),
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
    }


def run_schedule(accelerator, spec: dict, counter) -> dict:
    """Train `spec` on the launched ranks; return per-step gradient errors, counts and checks."""
    M, L = spec["M"], spec["L"]
    N = accelerator.num_processes
    X, Y = make_data(L * BATCH * N, seed=spec.get("data_seed", 1))
    accelerator.gradient_accumulation_steps = M
    accelerator.step = 0  # independent runs in one process; never touched within a run
    model = build_model(spec)
    expected = reference_steps(model, spec, X, Y, N)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        bf16 = spec.get("param_dtype") == "bf16"
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=False)
    config = accel_gradsync.GradSyncConfig(**spec.get("config", {}))
    result: dict = {"name": spec.get("name"), "error": None}
    with warnings.catch_warnings(record=True) as at_attach:
        warnings.simplefilter("always")
        if spec.get("attach_before_prepare"):
            handle = accel_gradsync.attach(accelerator, config)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        else:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            handle = accel_gradsync.attach(accelerator, config)
    result["attach_warnings"] = [
        str(w.message) for w in at_attach if issubclass(w.category, accel_gradsync.GradSyncWarning)
    ]
    adapter = adapt_model(model)
    is_fsdp2 = adapter is not None and adapter.kind == "fsdp2"
    flags0 = sync_flags(model) if is_fsdp2 else None
    sharded = dict(model.named_parameters()) if is_fsdp2 else None  # the optimizer's, whatever is gathered later
    result["bound_at_prepare"] = handle.plan() is not None
    if handle.plan() is None:  # bind() is public: do what the first no_sync() would do
        handle.bind(model)
    plan = handle.plan()  # for the failure messages; the tests derive what must run (expected_counts.py)
    result["plan"] = {
        "mode": plan.mode,
        "held": [u.name for u in plan.held],
        "windowed": [u.name for u in plan.windowed],
    }

    other = nn.Linear(2, 2)  # trained by nothing: `other_step` steps its optimizer between forward and backward
    other.weight.grad, other.bias.grad = torch.zeros_like(other.weight), torch.zeros_like(other.bias)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=LR)
    order = positions(spec)
    steps, aborts, syncs_as_planned, flags_inside, flags_between = [], [], [], [], []
    held_after_step = []
    counter.take()
    i = 0
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        try:
            for _ in range(spec.get("epochs", 1)):
                for x, y in loader:
                    pos = order[i]
                    i += 1
                    if pos["c"] == 0 and pos["M"] != accelerator.gradient_accumulation_steps:
                        accelerator.gradient_accumulation_steps = pos["M"]  # between optimizer steps
                    try:
                        with accelerator.accumulate(model):
                            inside = sync_flags(model) if is_fsdp2 else None
                            syncs_as_planned.append(accelerator.sync_gradients == pos["final"])
                            kwargs = route(spec.get("route", ""), pos) if spec.get("model") == "cond" else {}
                            if spec.get("backwards") == "split":  # all but the last half here
                                for h in range(BATCH - 1):
                                    half = F.mse_loss(model(x[h : h + 1], **kwargs).float(), y[h : h + 1])
                                    accelerator.backward(half / BATCH)
                                x, y = x[BATCH - 1 :], y[BATCH - 1 :]
                            loss = F.mse_loss(model(x, **kwargs).float(), y)
                            if spec.get("backwards") == "split":
                                loss = loss / BATCH
                            if spec.get("backwards") == "retain":
                                accelerator.backward(loss / 2, retain_graph=True)
                                loss = loss / 2
                            if spec.get("other_step") and pos["final"]:  # another model's optimizer (a GAN's)
                                other_optimizer.step()
                            if pos["raise"] == "forward":
                                raise RuntimeError(INJECTED)
                            if pos["raise"] == "skip":  # a loss guard: no backward, and past the step
                                continue
                            accelerator.backward(loss)
                            if pos["raise"] == "after_backward":
                                raise RuntimeError(INJECTED)
                            if pos["raise"] == "keyboard":
                                raise KeyboardInterrupt(INJECTED)
                            if spec.get("clip_every"):  # unconditionally; too large a norm to scale anything
                                accelerator.clip_grad_norm_(model.parameters(), 1e9)
                            if spec.get("log_every"):  # the loss averaged over ranks, for a logger
                                accelerator.reduce(loss.detach(), reduction="mean")
                            if spec.get("eval_mid") and not pos["final"]:  # an evaluation inside the window
                                with torch.no_grad():
                                    model(x, **kwargs)
                            if spec.get("extra_forward") and pos["final"]:  # a metric: no backward
                                with torch.set_grad_enabled(spec["extra_forward"] != "no_grad"):
                                    model(x, **kwargs)
                            if accelerator.sync_gradients:
                                counts = counter.take()
                                with counter.paused():
                                    grads = full_grads(model, sharded)
                                want = expected[len(steps)] if len(steps) < len(expected) else {}
                                steps.append(
                                    {
                                        "reduce_scatters": counts.get("reduce_scatter_single", 0)
                                        + counts.get("reduce_scatter_tensor", 0),
                                        "all_gathers": counts.get("all_gather_single", 0)
                                        + counts.get("all_gather_into_tensor", 0),
                                        **compare(grads, want),
                                    }
                                )
                            optimizer.step()
                            optimizer.zero_grad()
                            if accelerator.sync_gradients and adapter is not None:
                                held_after_step.append(adapter.held_grad_bytes())
                        if is_fsdp2 and pos["final"]:  # a window holds its flags until its last forward
                            flags_between.append(sync_flags(model) == flags0)
                            flags_inside.append(inside)
                    except (RuntimeError, KeyboardInterrupt) as err:
                        if str(err) != INJECTED:
                            raise
                        if spec.get("zero_grad_on_abort", True):
                            model.zero_grad(set_to_none=True)  # what a user's handler does
                        aborts.append(
                            {
                                "flags_restored": sync_flags(model) == flags0 if is_fsdp2 else True,
                                "held_after_zero_grad": adapter.held_grad_bytes() if adapter is not None else 0,
                            }
                        )
        except Exception as err:  # a failure of torch or the plugin: report it, do not hang the other runs
            result["error"] = f"{type(err).__name__}: {err}"[:2000]
    result.update(
        steps=steps,
        expected_steps=len(expected),
        aborts=aborts,
        syncs_as_planned=all(syncs_as_planned) and len(syncs_as_planned) == len(order),
        flags_end=(sync_flags(model) == flags0) if is_fsdp2 else True,
        flags_between=all(flags_between),
        held_units_inside=[sorted(n for n, f in fl.items() if not f[0]) for fl in flags_inside if fl is not None],
        held_after_step=held_after_step,
        train_warnings=[str(w.message) for w in during if issubclass(w.category, accel_gradsync.GradSyncWarning)],
        stats=handle.stats(),
        wrapper=adapter.kind if adapter is not None else None,
    )
    handle.detach()
    accelerator.free_memory()
    if plugin is not None:
        plugin.mixed_precision_policy = None
    return result
