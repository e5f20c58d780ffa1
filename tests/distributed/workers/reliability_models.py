"""Real transformers models under FSDP2 (or the launch's FSDP1) through accelerate: a tiny Qwen2 with
tied input/output embeddings, and the same model with PEFT LoRA adapters (only the adapters train). For each
sync mode, every optimizer step's gradients are compared with a single-process reference, and
the plan's units and held bytes with the trainable parameters."""

import copy
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, full_grads, parse_args, tiny_qwen2_config, write_result
from schedules import compare
from transformers import Qwen2ForCausalLM

import accel_gradsync

VOCAB, SEQ, B = 48, 8, 2

args = parse_args(
    [
        (("--runs",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 3}),
        (("--batches",), {"type": int, "default": 4}),
        (("--trainer-errors",), {"action": "store_true"}),
        (("--trainer-window",), {"action": "store_true"}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
N, M = accelerator.num_processes, args.M
g = torch.Generator().manual_seed(3)
IDS = torch.randint(0, VOCAB, (args.batches * N * B, SEQ), generator=g)


def build(kind: str) -> torch.nn.Module:
    set_seed(0)
    config = tiny_qwen2_config(vocab_size=VOCAB)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zeros by default, which would make lora_A's gradients zero
                torch.nn.init.normal_(p, std=0.05)
    return model


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def reference(model):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    steps = []
    for k in range(args.batches):
        (loss_of(ref, IDS[k * N * B : (k + 1) * N * B]) / M).backward()
        if (k + 1) % M == 0 or k + 1 == args.batches:
            steps.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    return steps


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


result = {}
for run in args.runs:
    model = build(run["model"])
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    layers_numel = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    expected = reference(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loader = torch.utils.data.DataLoader(IDS, batch_size=B, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    counter.take()
    steps, error = [], None
    try:
        for ids in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, ids))
                if accelerator.sync_gradients:
                    counts = counter.take()
                    with counter.paused():
                        grads = {clean(n): t for n, t in full_grads(model).items()}
                    # FSDP1's summon_full_params(with_grads=True) shows the frozen parameters that
                    # share a flat parameter with trainable ones (LoRA's base) a gradient: zeros.
                    frozen = [t.abs().max().item() for n, t in grads.items() if n not in trainable]
                    grads = {n: t for n, t in grads.items() if n in trainable}
                    want = expected[len(steps)] if len(steps) < len(expected) else {}
                    # FSDP2 calls reduce_scatter_single, FSDP1 reduce_scatter_tensor.
                    reduce_scatters = counts.get("reduce_scatter_single", 0) + counts.get("reduce_scatter_tensor", 0)
                    step = {"reduce_scatters": reduce_scatters, "frozen_grad_max": max(frozen, default=0.0)}
                    steps.append({**step, **compare(grads, want)})
                optimizer.step()
                optimizer.zero_grad()
    except Exception as err:
        error = f"{type(err).__name__}: {err}"[:2000]
    plan = handle.plan()
    units = handle.units()
    result[run["name"]] = {
        "error": error,
        "steps": steps,
        "expected_steps": len(expected),
        "trainable_numel": sum(trainable.values()),
        "layers_numel": layers_numel,
        "trainable_names": sorted(trainable),
        "units": {u.name: u.numel for u in units},
        "unit_collectives": sum(u.collectives for u in units),
        "plan": {"mode": plan.mode, "held": [u.name for u in plan.held], "held_bytes": plan.held_bytes()},
        "stats": handle.stats(),
    }
    handle.detach()
    accelerator.free_memory()
out = {"runs": result}

if args.trainer_window:
    # The Trainer enters no_sync itself (not accumulate()): the window's flags must still be set
    # once, held between its micro-batches, and back before the optimizer step.
    from common import sync_flags
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Watch(TrainerCallback):
        def __init__(self) -> None:
            self.seen: dict[str, list] = {"before": [], "between": [], "after_step": []}

        def flags(self, key: str, model) -> None:
            self.seen[key].append(sync_flags(model))

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.flags("before", trainer.model_wrapped)

        def on_substep_end(self, args, state, control, **kw):
            self.flags("between", trainer.model_wrapped)

        def on_step_end(self, args, state, control, **kw):
            self.flags("after_step", trainer.model_wrapped)

    targs = TrainingArguments(
        output_dir=f"{args.out}/trainer_windowed",
        per_device_train_batch_size=B,
        gradient_accumulation_steps=M,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        learning_rate=0.1,
        accelerator_config={"use_configured_state": True},
    )
    dataset = [{"input_ids": ids, "labels": ids} for ids in IDS] * 2
    watch = Watch()
    trainer = Trainer(model=build("tied"), args=targs, train_dataset=dataset, callbacks=[watch])
    handle = accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(defer=True, keep_params_unsharded=True))
    trainer.train()
    out["trainer_windowed"] = {**watch.seen, "steps": trainer.state.global_step, "stats": handle.stats()}
    handle.detach()

if args.trainer_errors:
    # Last: the Trainer's accelerator shares accelerate's state (and its sync_each_batch) with ours.
    import os

    from transformers import Trainer, TrainingArguments

    out_dir = os.path.join(args.out, "trainer")
    targs = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=B,
        gradient_accumulation_steps=M,
        max_steps=2,
        report_to=[],
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        accelerator_config={"use_configured_state": True, "gradient_accumulation_kwargs": {"sync_each_batch": True}},
    )
    dataset = [{"input_ids": ids, "labels": ids} for ids in IDS]
    trainer = Trainer(model=build("tied"), args=targs, train_dataset=dataset)
    errors = {}
    try:
        accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(defer=True))
        trainer.train()
        errors["sync_each_batch"] = "no error"
    except (ValueError, TypeError) as err:
        errors["sync_each_batch"] = f"{type(err).__name__}: {err}"
    errors["written"] = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    errors["global_step"] = trainer.state.global_step
    out["trainer_errors"] = errors
write_result(args.out, out)
