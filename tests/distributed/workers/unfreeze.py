"""Progressive unfreezing under one `attach` (after prepare, deferred sync, M micro-batches): a
`policy` trains throughout; `late` is prepared with no trainable parameter (bound as a reference
model), runs `--steps` optimizer steps frozen inside `accumulate(policy, late)`, then its
parameters are set to require gradients and it trains for `--steps` more; then `policy` is frozen
whole and `late` trains alone for `--steps` more. Per phase: the collectives counted from outside,
`stats()` and the decision lines printed; and after each phase every parameter of both models
beside an unwrapped replica trained on every rank's data in one process (the gradient per-micro-
batch sync would give: the mean over ranks of each micro-batch's gradient, summed over M)."""

import contextlib
import copy
import io

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, TinyNet, make_data, parse_args, write_result

import accel_gradsync

args = parse_args([(("--M",), {"type": int, "default": 4}), (("--steps",), {"type": int, "default": 2})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
set_seed(0)
policy, late = TinyNet(), TinyNet()
late.requires_grad_(False)
replicas = copy.deepcopy(policy), copy.deepcopy(late)
policy_opt = torch.optim.SGD(policy.parameters(), lr=0.1)
late_opt = torch.optim.SGD(late.parameters(), lr=0.1)
policy, policy_opt = accelerator.prepare(policy, policy_opt)
late, late_opt = accelerator.prepare(late, late_opt)
replica_opt = torch.optim.SGD([p for m in replicas for p in m.parameters()], lr=0.1)
ranks, micro = accelerator.num_processes, 2
data = [make_data(args.M * args.steps * 3 * micro, seed=r) for r in range(ranks)]
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(defer=True))
at_attach = [line for line in printed.getvalue().splitlines() if line.startswith("grad sync:")]


def loss_of(models, x, y):
    first, second = models
    return ((first(x) - y) ** 2).mean() + ((second(x) - y) ** 2).mean()


def params(model) -> dict:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def run_phase(phase: int) -> dict:
    printed.seek(0), printed.truncate()
    counter.take()
    with contextlib.redirect_stdout(printed):
        for step in range(args.steps):
            for m in range(args.M):
                k = ((phase * args.steps + step) * args.M + m) * micro
                X, Y = data[accelerator.process_index]
                with accelerator.accumulate(policy, late):
                    accelerator.backward(loss_of((policy, late), X[k : k + micro], Y[k : k + micro]))
                    if accelerator.sync_gradients:
                        policy_opt.step(), late_opt.step()
                        policy_opt.zero_grad(), late_opt.zero_grad()
                # The replica: every rank's micro-batch, as FSDP averages them, over M (accelerate's scaling).
                replica_loss = sum(loss_of(replicas, X[k : k + micro], Y[k : k + micro]) for X, Y in data)
                (replica_loss / (ranks * args.M)).backward()
            replica_opt.step(), replica_opt.zero_grad()
    counts = counter.take()
    stats = handle.stats()
    differences = {
        name: max((live[n] - ref[n]).abs().max().item() for n in ref)
        for name, model, replica in (("policy", policy, replicas[0]), ("late", late, replicas[1]))
        for live, ref in [(params(model), dict(replica.named_parameters()))]
    }
    return {
        "reduce_scatters": counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0),
        "stats": stats,
        "decisions": [line for line in printed.getvalue().splitlines() if line.startswith("grad sync:")],
        "max_param_diff": differences,
    }


phases = [run_phase(0)]
# FSDP2 sets each unsharded parameter's requires_grad from its sharded one at every all-gather:
# change it on the sharded ones. The root of a model nothing trains stays unsharded after its
# forward (FSDP2's root default, which only a backward ends), so reshard it first.
late.reshard()
late.requires_grad_(True)
for replica_param in replicas[1].parameters():
    replica_param.requires_grad_(True)
phases.append(run_phase(1))
policy.reshard()
policy.requires_grad_(False)
for replica_param in replicas[0].parameters():
    replica_param.requires_grad_(False)
phases.append(run_phase(2))
write_result(args.out, {"at_attach": at_attach, "phases": phases})
