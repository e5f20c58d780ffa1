"""Progressive unfreezing after a run (two_models.py `--unfreeze`), under the same `attach`
(deferred, M micro-batches): `late`, a model prepared with no trainable parameter (bound as a
reference model), has its parameters set to require gradients and trains inside
`accumulate(policy, late)` for `steps` optimizer steps; then `policy` is frozen whole and `late`
trains alone for `steps` more. Per phase: the collectives counted from outside, `stats()`, the
decision lines printed, and every parameter of both models beside an unwrapped replica trained on
every rank's data in one process (the gradient per-micro-batch sync gives: the mean over ranks
of each micro-batch's gradient, summed over M), built from the models' full parameters at start."""

from __future__ import annotations

import contextlib
import io

import torch
from common import make_data
from torch.distributed.fsdp import FSDPModule

MICRO = 2  # samples per micro-batch and rank


def reshard_all(model) -> None:
    """Reshard every FSDP2 unit of `model`: a root left unsharded by a forward, and every unit of a
    reference model kept resident (`reshard()` reshards one unit, not those inside it)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_params(model) -> dict:
    """By name, gathered from the shards (every unit resharded first)."""
    reshard_all(model)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def replica_of(model, fresh):
    """`fresh` (an unwrapped model of `model`'s class) with `model`'s full parameters."""
    fresh.load_state_dict(full_params(model))
    for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        q.requires_grad_(p.requires_grad)
    return fresh


def loss_of(models, x, y):
    first, second = models
    return ((first(x) - y) ** 2).mean() + ((second(x) - y) ** 2).mean()


def run_unfreezing(accelerator, handle, counter, models, optimizers, fresh, M: int, steps: int) -> list[dict]:
    """`models` = (policy, late), prepared; `optimizers` theirs (SGD); `fresh` two unwrapped
    models of their class for the replicas. Returns one record per phase."""
    policy, late = models
    # FSDP2 sets each unsharded parameter's requires_grad from its sharded one at every all-gather:
    # change it on the sharded ones. The root of a model nothing trains stays unsharded after its
    # forward (FSDP2's default for a root, which only a backward ends), and a resident one keeps
    # every unit gathered: reshard them first.
    reshard_all(late)
    replicas = [replica_of(m, f) for m, f in zip(models, fresh, strict=True)]
    lr = 0.1
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    replica_opt = torch.optim.SGD([p for m in replicas for p in m.parameters()], lr=lr)
    ranks = accelerator.num_processes
    data = [make_data(M * steps * 2 * MICRO, seed=100 + r) for r in range(ranks)]

    def phase(index: int) -> dict:
        printed = io.StringIO()
        counter.take()
        with contextlib.redirect_stdout(printed):
            for step in range(steps):
                for m in range(M):
                    k = ((index * steps + step) * M + m) * MICRO
                    X, Y = data[accelerator.process_index]
                    with accelerator.accumulate(policy, late):
                        accelerator.backward(loss_of(models, X[k : k + MICRO], Y[k : k + MICRO]))
                        if accelerator.sync_gradients:
                            for optimizer in optimizers:
                                optimizer.step(), optimizer.zero_grad()
                    # Every rank's micro-batch, averaged as FSDP does, over M (accelerate's scaling).
                    replica_loss = sum(loss_of(replicas, X[k : k + MICRO], Y[k : k + MICRO]) for X, Y in data)
                    (replica_loss / (ranks * M)).backward()
                replica_opt.step(), replica_opt.zero_grad()
        counts = counter.take()
        differences = {}
        for name, model, replica in zip(("policy", "late"), models, replicas, strict=True):
            live, ref = full_params(model), dict(replica.named_parameters())
            differences[name] = max((live[n] - ref[n]).abs().max().item() for n in ref)
        return {
            "reduce_scatters": counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0),
            "stats": handle.stats(),
            "decisions": [line for line in printed.getvalue().splitlines() if line.startswith("grad sync:")],
            "max_param_diff": differences,
        }

    late.requires_grad_(True)
    replicas[1].requires_grad_(True)
    phases = [phase(0)]
    policy.reshard()
    policy.requires_grad_(False)
    replicas[0].requires_grad_(False)
    phases.append(phase(1))
    return phases
