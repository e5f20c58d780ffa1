"""accelerate's `save_state` / `load_state` in the middle of a run, with a sync mode attached.

One uninterrupted run gives the reference. A second run saves twice without stopping (at a
window boundary, right after an optimizer step, and in the middle of a window, while deferred
gradients are held) and must end exactly where the reference ends. Then a fresh model and
optimizer resume from each checkpoint (skipping the micro-batches already seen) and must end
there too: no deferred gradient lost or counted twice."""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from common import TinyNet, full_grads, make_data
from schedules import compare
from torch.utils.data import DataLoader, TensorDataset

import accel_gradsync

M, L, B, LR = 3, 9, 2, 0.1
BOUNDARY, MIDDLE = 2, 4  # save after micro-batch 2 (ends window 1) and after 4 (inside window 2)


def _params(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().clone()
    return out


def _train(accelerator, config: dict, seed: int, ckpt: dict, resume_from: str | None = None, skip: int = 0):
    """Micro-batches `skip`..L-1; saves where `ckpt` ({index: dir}) says; returns final params,
    each optimizer step's gradients and the accelerate step counter after loading."""
    N = accelerator.num_processes
    X, Y = make_data(L * B * N)
    accelerator.gradient_accumulation_steps = M
    set_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config))
    step_after_load = None
    if resume_from is not None:
        accelerator.load_state(resume_from)
        step_after_load = accelerator.step
        loader = accelerator.skip_first_batches(loader, skip)
    grads = []
    for k, (x, y) in enumerate(loader, start=skip):
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                grads.append({n: t for n, t in full_grads(model).items()})
            optimizer.step()
            optimizer.zero_grad()
        if k in ckpt:
            accelerator.save_state(ckpt[k])
    params = _params(model)
    handle.detach()
    accelerator.free_memory()
    return params, grads, step_after_load


def run_checkpoint(accelerator, config: dict, root: str) -> dict:
    ckpt = {BOUNDARY: os.path.join(root, "boundary"), MIDDLE: os.path.join(root, "middle")}
    ref_params, ref_grads, _ = _train(accelerator, config, seed=0, ckpt={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", accel_gradsync.GradSyncWarning)
        saved_params, saved_grads, _ = _train(accelerator, config, seed=0, ckpt=ckpt)
    out = {
        "save_warnings": [str(w.message) for w in caught if issubclass(w.category, accel_gradsync.GradSyncWarning)],
        "files": {
            name: sorted(os.listdir(path)) for name, path in (("boundary", ckpt[BOUNDARY]), ("middle", ckpt[MIDDLE]))
        },
        "save_and_continue": compare(saved_params, ref_params),
        "save_and_continue_grads": [compare(a, b)["max_diff"] for a, b in zip(saved_grads, ref_grads, strict=True)],
    }
    for name, index in (("boundary", BOUNDARY), ("middle", MIDDLE)):
        # A different seed, so only load_state can make the weights right.
        params, grads, step = _train(accelerator, config, seed=1, ckpt={}, resume_from=ckpt[index], skip=index + 1)
        out[f"resume_{name}"] = compare(params, ref_params)
        out[f"resume_{name}_steps"] = len(grads)
        out[f"resume_{name}_accelerate_step"] = step
    out["reference_steps"] = len(ref_grads)
    return out
