"""Measure what `accel_gradsync.estimator.step_peak` forecasts: for each model spec and sync mode,
one optimizer step of M micro-batches (AdamW, micro-batches of --mbs x --seq tokens) after a
warm-up step, under the launched accelerate config (FSDP2), with gradient checkpointing as asked;
reports the peak live tensor bytes of this rank over the measured step, read by torch's
`MemTracker` wrapped around the real step (the params and optimizer state it finds already alive
are registered with `track_external`; a LoRA model is measured with `FSDPMemTracker`, see `new_tracker`)."""

import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import parse_args, write_result
from peft import LoraConfig, get_peft_model
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, LogitsProcessorList

import accel_gradsync
from accel_gradsync.estimator.fake_step import enable_checkpointing
from accel_gradsync.estimator.inputs import load_model_config

args = parse_args(
    [
        (("--models",), {"required": True, "help": "JSON list of model specs"}),
        (("--modes",), {"default": "per_micro_batch,deferred"}),
        (("--M",), {"type": int, "default": 2}),
        (("--mbs",), {"type": int, "default": 2}),
        (("--seq",), {"type": int, "default": 64}),
        (("--memory-budget",), {"default": "1GiB"}),
        (("--free-memory",), {"default": "40GiB"}),
        (("--checkpointing",), {"action": "store_true"}),
        # GRPO's generation after the measured step: M x mbs sequences, the last L of --seq tokens generated.
        (("--generate",), {"type": int, "default": 0}),
        (("--lora-r",), {"type": int, "default": 0}),  # a LoRA fine-tune of this rank (PEFT's default modules)
    ]
)
assert not (args.generate and args.checkpointing), "TRL generates with gradient checkpointing off"
accel_gradsync.enable_cpu_fsdp()
accelerator = Accelerator(gradient_accumulation_steps=args.M)


def new_tracker(model, optimizer):
    """torch's MemTracker, with the params and optimizer state it finds alive registered; for a LoRA
    model FSDPMemTracker, since MemTracker hooks the gradient of every param and torch refuses a
    hook on a frozen one."""
    if args.lora_r:
        return FSDPMemTracker(model, optimizer.optimizer)  # the torch optimizer accelerate wraps
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def micro_batch(model, vocab: int, k: int) -> None:
    ids = torch.randint(0, vocab, (args.mbs, args.seq), generator=torch.Generator().manual_seed(k))
    accelerator.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)


results = []
for spec in json.loads(args.models):
    model_config = load_model_config(spec)
    for mode in args.modes.split(","):
        set_seed(0)
        window = mode == "deferred+windowed"  # the estimate's row for deferral with keep_params_unsharded
        sync_mode, _, budget = mode.partition("@")  # budget@300KiB: a budget of its own
        config = accel_gradsync.GradSyncConfig(
            sync_mode="deferred" if window else sync_mode,
            keep_params_unsharded=window,
            memory_budget=budget or args.memory_budget,
            free_memory=args.free_memory,
        )
        handle = accel_gradsync.attach(accelerator, config)
        model = AutoModelForCausalLM.from_config(model_config)
        if args.lora_r:
            model = get_peft_model(model, LoraConfig(r=args.lora_r, task_type="CAUSAL_LM"))
        if args.checkpointing:
            enable_checkpointing(model)  # non-reentrant, every decoder layer, as the forecast's
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        vocab = model_config.vocab_size
        for k in range(args.M):  # warm-up: creates the optimizer state; auto measures it and plans
            with accelerator.accumulate(model):
                micro_batch(model, vocab, k)
                optimizer.step()
                optimizer.zero_grad()
        tracker = new_tracker(model, optimizer)
        with tracker:
            for k in range(args.M, 2 * args.M):
                tracker.reset_mod_stats()  # per-module stats refuse a second call; the peak is kept
                with accelerator.accumulate(model):
                    micro_batch(model, vocab, k)
                    optimizer.step()
                    optimizer.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
        generation_peak = None
        if args.generate:
            prompt = torch.randint(0, vocab, (args.M * args.mbs, args.seq - args.generate))
            tracker = new_tracker(model, optimizer)

            def next_token(input_ids, scores, tracker=tracker):  # MemTracker refuses a module's 2nd forward
                tracker.reset_mod_stats()  # unless its stats are reset; the peak is kept
                return scores

            with tracker, torch.no_grad():  # as TRL generates: sampling, checkpointing off, no early stop
                model.generate(
                    input_ids=prompt,
                    do_sample=True,
                    max_new_tokens=args.generate,
                    min_new_tokens=args.generate,
                    logits_processor=LogitsProcessorList([next_token]),
                )
            generation_peak = max(int(dev["Total"]) for dev in tracker.get_tracker_snapshot("peak").values())
        results.append(
            {
                "model": spec,
                "mode": mode,
                "peak_bytes": max(int(dev["Total"]) for dev in peak.values()),
                "generation_peak_bytes": generation_peak,
                "peak": {
                    str(dev): {str(getattr(k, "value", k)): int(v) for k, v in s.items()} for dev, s in peak.items()
                },
                "stats": {k: v for k, v in handle.stats().items() if k.startswith("last_step/")},
                "plan": handle.plan().mode if handle.plan() is not None else None,
                "windowed": len(handle.plan().windowed) if handle.plan() is not None else 0,
                "held": len(handle.plan().held) if handle.plan() is not None else 0,
            }
        )
        handle.detach()
        del model, optimizer, tracker
        accelerator.free_memory()

write_result(args.out, {"results": results})
