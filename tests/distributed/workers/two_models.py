"""Two trained models on one accelerator (a policy and a value model, each prepared with its own
optimizer as accelerate's FSDP2 requires) and a frozen reference model, one `attach`, deferred
sync (or `--sync`'s settings): what the handle counts against the collectives counted from
outside, the gradient bytes of each model's trainable parameters (what a deferred model holds
unsharded), each unit's parameter bytes, each trained model's plan, and the decision lines it
printed. `--unfreeze`: then the reference model is unfrozen and trained beside the policy, and the
policy frozen whole (unfreezing.py)."""

import contextlib
import io
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, make_data, parse_args, write_result
from unfreezing import run_unfreezing

import accel_gradsync

args = parse_args(
    [
        (("--M",), {"type": int, "default": 4}),
        (("--steps",), {"type": int, "default": 2}),
        (("--sync",), {"default": '{"defer": true}', "help": "GradSyncConfig keys as JSON"}),
        (("--unfreeze",), {"action": "store_true", "help": "then run unfreezing.py's phases"}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
set_seed(0)
policy, value, reference = TinyNet(), TinyNet(), TinyNet()
reference.requires_grad_(False)
# Read before wrapping, from the parameters themselves: each deferred model holds this unsharded.
grad_bytes = [sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) for m in (policy, value)]
# Each FSDP unit's parameter bytes (two blocks, then the root's head), before wrapping.
unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in (*reference.blocks, reference.head)]
policy_opt = torch.optim.SGD(policy.parameters(), lr=0.1)
value_opt = torch.optim.SGD(value.parameters(), lr=0.1)
policy, policy_opt = accelerator.prepare(policy, policy_opt)
value, value_opt = accelerator.prepare(value, value_opt)
# accelerate's FSDP2 prepares a model only with an optimizer: the frozen one gets an idle one.
reference, reference_opt = accelerator.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.0))
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**json.loads(args.sync)))
X, Y = make_data(args.M * args.steps * 2, seed=accelerator.process_index)


def all_gathers() -> int:
    return sum(n for name, n in counter.counts.items() if "all_gather" in name)


counter.take()
reference_all_gathers = [0] * args.steps  # counted from outside: issued inside the reference's forwards
for k in range(args.M * args.steps):
    x, y = X[2 * k : 2 * k + 2], Y[2 * k : 2 * k + 2]
    with accelerator.accumulate(policy, value):
        before = all_gathers()
        with torch.no_grad():
            baseline = reference(x)
        reference_all_gathers[k // args.M] += all_gathers() - before
        loss = ((policy(x) - y) ** 2).mean() + ((value(x) - baseline) ** 2).mean()
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            policy_opt.step(), value_opt.step()
            policy_opt.zero_grad(), value_opt.zero_grad()
counts = counter.take()
stats = handle.stats()
# accelerate's save_state and load_state read and write every prepared model's state dict, the
# reference's too: FSDP2's own hooks reshard it, and its next forward gathers it again (counted
# from outside) and computes what it computed before.
x = X[:2]
with torch.no_grad():
    before_save = reference(x)
accelerator.save_state(str(Path(args.out, "checkpoint")))
gathers_at = all_gathers()
with torch.no_grad():
    after_save = reference(x)
accelerator.load_state(str(Path(args.out, "checkpoint")))
with torch.no_grad():
    after_load = reference(x)
checkpoint = {
    "all_gathers_after_save": all_gathers() - gathers_at,
    "same_output": bool(torch.equal(before_save, after_save) and torch.equal(before_save, after_load)),
}

# An exception inside the resident reference's forward, mid-unit (its second block's layer raises
# once): FSDP2 is left mid-forward, so the reference is released; its next forward gathers every
# unit again (counted from outside), the one after gathers nothing, and both compute what it did.
exception: dict = {}
if accelerator.is_fsdp2:

    def fail(module, inputs):
        raise RuntimeError("injected failure")

    failing = reference.blocks[1].proj.register_forward_pre_hook(fail)
    try:
        with torch.no_grad():
            reference(x)
    except RuntimeError as error:
        exception["raised"] = str(error)
    failing.remove()
    gathers_at = all_gathers()
    with torch.no_grad():
        outputs = [reference(x), reference(x)]
    two_forwards, gathers_at = all_gathers() - gathers_at, all_gathers()
    with torch.no_grad():
        outputs.append(reference(x))
    exception["all_gathers"] = [two_forwards, all_gathers() - gathers_at]
    exception["same_output"] = all(torch.equal(before_save, out) for out in outputs)
    exception["resident"] = handle.stats()["reference_models"]["TinyNet#3"]["resident"]
counter.take()
models, optimizers, fresh = (policy, reference), (policy_opt, reference_opt), (TinyNet(), TinyNet())
unfrozen = (
    run_unfreezing(accelerator, handle, counter, models, optimizers, fresh, args.M, args.steps) if args.unfreeze else []
)
write_result(
    args.out,
    {
        "unfreezing": unfrozen,
        "reference_all_gathers_per_step": reference_all_gathers,
        "checkpoint": checkpoint,
        "exception": exception,
        "counts": counts,
        "stats": {k: v for k, v in stats.items() if k != "models"},
        "models": stats["models"],
        "grad_bytes": grad_bytes,
        "unit_bytes": unit_bytes,
        "plans": [
            {"held": len(p.held), "held_grad_bytes": p.held_grad_bytes(), "generation_bytes": p.generation_bytes}
            for p in (handle.plan(policy), handle.plan(value))
            if p is not None
        ],
        "decisions": [line for line in printed.getvalue().splitlines() if line.startswith("grad sync:")],
    },
)
