"""Soak: train the recipe's default model (recipes/embedded.py: tiny Qwen2, tied embeddings) for
thousands of micro-batches per sync mode on the launched ranks, with an occasional injected
failure, and record after every optimizer step the gradient bytes FSDP still holds, the
process RSS and whether any unit's sync flags differ from their state before training."""

import importlib.util
import json
import time
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import TinyNet, parse_args, sync_flags, write_result
from torch.nn import functional as F

import accel_gradsync
from accel_gradsync.runtime.wrappers.adapt import adapt_model

args = parse_args(
    [
        (("--modes",), {"type": json.loads, "required": True}),
        (("--micro-batches",), {"type": int, "default": 2000}),
        (("--M",), {"type": int, "default": 4}),
        (("--fail-every",), {"type": int, "default": 97}),
    ]
)
REPO_ROOT = Path(__file__).resolve().parents[3]
accel_gradsync.enable_cpu_fsdp()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
process = psutil.Process()


def recipe_model():
    """The recipe's default model, or TinyNet (said in the result) if it cannot be imported."""
    try:
        spec = importlib.util.spec_from_file_location("recipe_embedded", REPO_ROOT / "recipes" / "embedded.py")
        embedded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(embedded)
        tokenizer = embedded.build_tokenizer()
        return "recipe_default", embedded.build_model(tokenizer), len(tokenizer)
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        return f"TinyNet (recipe model not importable: {err})", TinyNet(), None


result = {}
for name, config in args.modes.items():
    set_seed(0)
    kind, model, vocab = recipe_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.get("sync_mode") == "budget" and config.get("memory_budget") == "half":
        full = sum(u.held_bytes for u in adapt_model(model).units)
        config = {**config, "memory_budget": f"{full // 2}B"}
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**config))
    flags0 = sync_flags(model)
    adapter = adapt_model(model)
    g = torch.Generator().manual_seed(accelerator.process_index)
    held_after_step, rss, flag_leaks, failures = [], [], 0, 0
    start = time.time()
    for i in range(args.micro_batches):
        try:
            with accelerator.accumulate(model):
                if vocab is not None:
                    ids = torch.randint(0, vocab, (2, 16), generator=g)
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    x = torch.randn(2, 16, generator=g)
                    loss = F.mse_loss(model(x), x.sum(-1))
                accelerator.backward(loss)
                if args.fail_every and i % args.fail_every == args.fail_every - 1 and not accelerator.sync_gradients:
                    raise RuntimeError("injected failure")
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    held_after_step.append(adapter.held_grad_bytes())
                    rss.append(process.memory_info().rss)
        except RuntimeError as err:
            if str(err) != "injected failure":
                raise
            failures += 1
            model.zero_grad(set_to_none=True)
        flag_leaks += sync_flags(model) != flags0
    plan = handle.plan()
    result[name] = {
        "model": kind,
        "seconds": time.time() - start,
        "micro_batches": args.micro_batches,
        "failures": failures,
        "held_after_step": sorted(set(held_after_step)),
        "steps": len(held_after_step),
        "rss": rss,
        "flag_leaks": flag_leaks,
        "plan_held_bytes": plan.held_bytes(),
        "units_held": len(plan.held),
        "units": len(handle.units()),
        "stats": handle.stats(),
    }
    handle.detach()
    accelerator.free_memory()
write_result(args.out, result)
