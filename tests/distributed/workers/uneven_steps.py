"""Per-step micro-batch counts that differ across ranks: TinyNet trained over steps in which each
rank runs its own count (`--runs`: per run the GradSyncConfig, or none for stock accelerate, and
`counts`, per step each rank's count). `style` `step`: each step inside `grad_sync.step(n,
samples=...)`, each micro-batch's summed loss scaled by the step's samples over every rank;
`accelerate`: accelerate's own `gradient_accumulation_steps = n` and its counter restarted
before each step, without `step()`; `pad`: the reference, every rank runs the step's largest count with accelerate's own
`gradient_accumulation_steps` set to it, a rank past its own count repeating its last micro-batch
with loss x 0. A micro-batch has 1 to 3 rows (as a token budget packs them), the loop clips
gradients at every optimizer step and steps AdamW.

Reports per run: the collectives counted from outside per step, `stats()` (totals and last step),
the decision line at the end (`describe()`), where `grad_sync.preempted()` said True (`ask`: asked
after every micro-batch; `signal_at`: rank 1 sends itself SIGUSR1 before that step, and the run
stops after the step it agreed at; `save`: `accelerator.save_state` there, inside the block), the
final parameters compared bit for bit in the worker with the runs named in `references`, and the
message of a ValueError raised on this rank (`refuse`: one of the refusals to provoke; `uncaught`:
not caught, so the rank exits as a loop of the user's would)."""

import json
import os
import signal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, full_params, make_data, parse_args, write_result
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import accel_gradsync
from testbed.collectives import KIND

CLIP = 0.05  # below the gradients' norm: every step clips
# The loops that clip.
CLIPPED = ("clip", "loss_backward", "two_forwards", "reference", "evaluate")
CLIPPED += ("metric", "metric_grad", "split", "clip_every")
STATS = (
    "micro_batches",
    "optimizer_steps",
    "mode",
    "replayed_micro_batches",
    "evened_micro_batches",
    "last_step/fewest_micro_batches",
    "last_step/most_micro_batches",
    "last_step/replayed_micro_batches",
    "last_step/evened_micro_batches",
)

args = parse_args([(("--runs",), {"type": json.loads, "required": True})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator()
N, R = accelerator.num_processes, accelerator.process_index
X, Y = make_data(4096)


def rows(step: int, k: int, rank: int) -> int:
    """Rows of rank `rank`'s micro-batch `k` in step `step`: 1 to 3, as a token budget packs them."""
    return 1 + (step + k + rank) % 3


def batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch k of step `step` (no two alike)."""
    start = (step * 64 + k * 8 + R * 4) * 3
    n = rows(step, k, R)
    return X[start : start + n], Y[start : start + n]


def samples_of(step: int, counts: list[int]) -> int:
    """The step's samples over every rank, from the rows each rank's micro-batches have."""
    return sum(rows(step, k, r) for r, n in enumerate(counts) for k in range(n))


class Loop:
    def __init__(self, reference: bool = False) -> None:
        set_seed(0)
        model = TinyNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.logged: list[float] = []
        self.ref = None
        if reference:  # a frozen reference model, as RL loops regularize against: another seed
            set_seed(1)
            ref = TinyNet().requires_grad_(False)  # accelerate's FSDP2 prepares a model with an optimizer
            self.ref, _ = accelerator.prepare(ref, torch.optim.SGD(ref.parameters(), lr=0.0))
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # DDP all-reduces from C++; the default hook does the same through torch.distributed.
            self.model.register_comm_hook(None, allreduce_hook)

    def micro_batch(self, x, y, samples: int, scale: float = 1.0, loop: str = "clip", fail: bool = False) -> None:
        """`loop`: `clip` (clip at the step, then step, inside the block), `no_clip` (step inside
        the block, no clip), `step_outside` (step after the block), `reduce_log` (the loss summed
        over ranks at the step, before stepping), `loss_backward` (`clip` with `loss.backward()`),
        `two_forwards` (`clip`, the model forwarded twice), `reference` (`clip`, the target moved
        half way to a frozen reference model's output, its forward without gradients first, as
        TRL's log-prob pass), `evaluate` (`clip`; `one_step` forwards the model without gradients
        after the block), `metric` / `metric_grad` (`clip`, the model forwarded once more after the
        step's last backward, without gradients / with them, and no backward), `clip_every` (`clip`,
        and a clip after every other micro-batch's backward too), `split` (`clip`, a
        backward per part of the micro-batch: its first row, then the rest, maybe none, each after
        its own forward). `fail`: raise after the forward."""
        with accelerator.accumulate(self.model):
            if loop == "reference":
                with torch.no_grad():
                    y = (y + self.ref(x)) / 2
            if loop == "split":
                part = F.mse_loss(self.model(x[:1]), y[:1], reduction="sum") * (N / samples)
                accelerator.backward(part * accelerator.gradient_accumulation_steps * scale)
                x, y = x[1:], y[1:]
            loss = F.mse_loss(self.model(x), y, reduction="sum") * (N / samples)
            if loop == "two_forwards":
                loss = loss + F.mse_loss(self.model(x * 0.5), y, reduction="sum") * (N / samples)
            if fail:
                raise RuntimeError("a micro-batch failed after its forward")
            if loop == "loss_backward":  # torch's own backward: accelerate divides nothing
                (loss * scale).backward()
            else:  # accelerate divides by gradient_accumulation_steps: the step's own count cancels it.
                accelerator.backward(loss * accelerator.gradient_accumulation_steps * scale)
            if accelerator.sync_gradients and loop in ("metric", "metric_grad"):
                with torch.set_grad_enabled(loop == "metric_grad"):
                    self.model(x)
            if loop == "clip_every" and not accelerator.sync_gradients:  # the step's own clip below
                accelerator.clip_grad_norm_(self.model.parameters(), 1e9)
            if accelerator.sync_gradients and loop in CLIPPED:
                accelerator.clip_grad_norm_(self.model.parameters(), CLIP)
            if accelerator.sync_gradients and loop == "reduce_log":
                self.logged.append(accelerator.reduce(loss.detach()[None] * scale, "sum").item())
            if loop != "step_outside":
                self.optimizer.step()
                self.optimizer.zero_grad()
        if loop == "step_outside":
            self.optimizer.step()
            self.optimizer.zero_grad()


def train(run: dict, handle, loop: Loop) -> list[dict]:
    per_step, style = [], run.get("loop", "clip")
    for s, counts in enumerate(run["counts"]):
        if run.get("signal_at") == s and R == 1:  # save_on_signal: one rank gets it before the step
            os.kill(os.getpid(), signal.SIGUSR1)
        try:
            one_step(run, handle, loop, s, counts, style)
        except RuntimeError:  # `raise_at`: every rank's first micro-batch of that step failed
            assert s == run.get("raise_at"), s
        ran = counter.take()
        per_step.append({kind: sum(c for name, c in ran.items() if KIND[name] == kind) for kind in set(KIND.values())})
        if preempted_at:  # agreed at this step's end: a loop would save and exit here
            break
    return per_step


def one_step(run: dict, handle, loop: Loop, s: int, counts: list[int], style: str) -> None:
    n, most, samples = counts[R], max(counts), samples_of(s, counts)
    fails = s == run.get("raise_at")

    def micro_batch(x, y, *args, **kwargs) -> None:
        loop.micro_batch(x, y, *args, **kwargs)
        if style == "evaluate":  # an evaluation after every micro-batch, outside accumulate()
            with torch.no_grad():
                loop.model(x)

    if run["style"] == "pad":
        accelerator.gradient_accumulation_steps, accelerator.step = most, 0
        for k in range(most):
            x, y = batch(s, min(k, n - 1))
            micro_batch(x, y, samples, scale=1.0 if k < n else 0.0, loop=style, fail=fails and k == 0)
    elif run["style"] == "accelerate":  # accelerate's own count, restarted: what step(n) sets
        accelerator.gradient_accumulation_steps, accelerator.step = n, 0
        for k in range(n):
            micro_batch(*batch(s, k), samples, loop=style, fail=fails and k == 0)
    else:
        mine = sum(rows(s, k, R) for k in range(n))
        with handle.step(n, samples=mine) as step:
            assert (step.largest, step.smallest, step.samples) == (most, min(counts), samples), step
            for k in range(n):
                micro_batch(*batch(s, k), step.samples, loop=style, fail=fails and k == 0)
                if run.get("ask") and handle.preempted():  # after every micro-batch, as docs/modes.md says
                    preempted_at.append([s, k])
                    if run.get("save"):  # what a loop does then: its state saved inside the block
                        where = os.path.join(args.out, f"state-{run['name'].replace('/', '-')}")
                        accelerator.save_state(where)
                        saved.append(sum(len(files) for _, _, files in os.walk(where)))


def refuse(run: dict, handle, loop: Loop) -> None:
    what = run["refuse"]
    if what == "zero_on_one_rank":
        with handle.step(0 if R == 1 else 2):
            pass
    elif what == "nested":
        with handle.step(1), handle.step(1):
            pass
    elif what == "inside_join":
        with handle.join(), handle.step(1):
            pass
    elif what == "mid_window":
        loop.micro_batch(*batch(0, 0), 8)  # the first of M = 2
        with handle.step(1):
            pass
    elif what == "ran_other_count":
        with handle.step(2):
            loop.micro_batch(*batch(0, 0), 8)
    elif what == "step_before_backward":  # rank 1 would replay after its backward; rank 0 replays nothing
        n = 1 if R == 1 else 2
        with handle.step(n):
            for k in range(n):
                x, y = batch(0, k)
                with accelerator.accumulate(loop.model):
                    loss = F.mse_loss(loop.model(x), y)
                    if k == n - 1:
                        loop.optimizer.step()
                    accelerator.backward(loss)
    elif what == "gather_every_micro_batch":  # counts 2 and 3: each rank gathers after every micro-batch
        n = 2 + R
        with handle.step(n):
            for k in range(n):
                loop.micro_batch(*batch(0, k), 8)
                accelerator.gather(torch.ones(1))
    elif what == "clip_every_micro_batch":  # counts 2 and 3: each rank clips after every micro-batch
        n = 2 + R
        with handle.step(n):
            for k in range(n):
                loop.micro_batch(*batch(0, k), 8, loop="clip_every")
    elif what == "forward_between_micro_batches":  # counts 2 and 3: an evaluation after every micro-batch
        n = 2 + R
        with handle.step(n):
            for k in range(n):
                loop.micro_batch(*batch(0, k), 8)
                with torch.no_grad():  # outside accumulate(): FSDP2 all-gathers for it under deferred
                    loop.model(batch(0, k)[0])
    elif what == "prepared_dataloader":
        loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
        for _ in loader:
            with handle.step(1):
                pass


result: dict = {"runs": {}}
params: dict[str, dict] = {}
preempted_at: list[list[int]] = []  # [step, micro-batch] where grad_sync.preempted() said True
saved: list[int] = []  # the files of each accelerator.save_state() there (`save`)
for run in args.runs:
    accelerator.gradient_accumulation_steps = 2
    loop = Loop(reference=run.get("loop") == "reference")
    config = run.get("config")
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config)) if config is not None else None
    accelerator.step = 0
    accelerator.gradient_state._set_sync_gradients(True)  # a run that ended mid-window left it False
    counter.take()
    out: dict = {"error": None}
    preempted_at.clear()
    saved.clear()
    try:
        if "refuse" in run:
            refuse(run, handle, loop)
        else:
            out["per_step"] = train(run, handle, loop)
    except ValueError as e:
        if run.get("uncaught"):  # as a loop of the user's: the rank exits, the launcher ends the run
            raise
        out["error"] = str(e)
    if handle is not None:
        out["decision"], out["preempted_at"], out["saved"] = handle.describe(), list(preempted_at), list(saved)
        stats = handle.stats()
        out["stats"] = {k: stats[k] for k in STATS}
        handle.detach()
    if out["error"] is None and "refuse" not in run:
        params[run["name"]] = full_params(loop.model)
        out["equal"], out["logged"] = {}, loop.logged
        for ref in run.get("references", []):
            mine, theirs = params[run["name"]], params[ref]
            out["equal"][ref] = all(torch.equal(mine[n], theirs[n]) for n in theirs)
            out.setdefault("max_diff", {})[ref] = max((mine[n] - theirs[n]).abs().max().item() for n in theirs)
    result["runs"][run["name"]] = out
    accelerator.free_memory()
    del loop

write_result(args.out, result)
