"""A model transformers shards at load time (`from_pretrained(..., distributed_config=
DistributedConfig(fsdp_size=..., dp_replicate_size=...))`), trained in each sync mode by the
`Trainer` (which defers through its own `_defer_fsdp_gradient_reduction`, not accelerate's
`no_sync`) and by a plain loop that enters `accelerator.no_sync(model)` itself. Per run: the real
collectives counted from outside, the plugin's `stats()`, its decision line and the logged losses
and final weights, so the test compares what ran with what the plugin says."""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from common import CollectiveCounter, parse_args, write_result
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import accel_gradsync

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes"))  # the recipe's `embedded` prompts
M, STEPS, BATCH, SEQ = 4, 2, 2, 8

args = parse_args(
    [
        (("--model",), {"required": True}),
        (("--replicate",), {"type": int, "default": 1}),
        # [{"name": ..., "entry": "trainer" | "grpo" | "loop", "config": GradSyncConfig kwargs, "lora": bool}, ...]
        (("--runs",), {"type": json.loads, "required": True}),
    ]
)
counter = CollectiveCounter()
world = int(os.environ["WORLD_SIZE"])


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same global batches in every run."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def load_model(lora: bool = False):
    """The model transformers shards at load time; with `lora`, a PEFT LoRA adapter added after that
    sharding (its weights plain tensors beside the FSDP2 units, which transformers' Trainer
    broadcasts and all-reduces itself)."""
    config = DistributedConfig(fsdp_size=world // args.replicate, dp_replicate_size=args.replicate)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def full_weights(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).tolist() for n, p in model.named_parameters()}


def train_with_trainer(config: accel_gradsync.GradSyncConfig, out_dir: str, lora: bool = False):
    model = load_model(lora)
    training = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=M,
        max_steps=STEPS,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        optim="sgd",  # Adam would magnify rounding near zero
    )
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    handle = accel_gradsync.attach(trainer, config)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return model, handle, losses, type(trainer).__name__


def train_with_grpo(config: accel_gradsync.GradSyncConfig, out_dir: str):
    """TRL's GRPOTrainer (a Trainer subclass) on the recipe's built-in prompts and tokenizer."""
    import embedded
    from trl import GRPOConfig, GRPOTrainer

    model = load_model()
    training = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=M,
        num_generations=8,
        max_completion_length=4,
        max_steps=STEPS,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[embedded.REWARD_FUNCS["accuracy"]],
        args=training,
        train_dataset=embedded.build_dataset(),
        processing_class=embedded.build_tokenizer(),
    )
    handle = accel_gradsync.attach(trainer, config)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return model, handle, losses, type(trainer).__name__


def train_with_loop(config: accel_gradsync.GradSyncConfig):
    """accelerate's documented accumulation loop without `accumulate()`: no_sync on all but every M-th."""
    model = load_model()
    accelerator = Accelerator()
    handle = accel_gradsync.attach(accelerator, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data, rank, losses = Tokens(), int(os.environ["RANK"]), []
    for i in range(M * STEPS):
        start = (i * world + rank) * BATCH
        batch = torch.stack([data[j]["input_ids"] for j in range(start, start + BATCH)])
        if (i + 1) % M != 0:
            with accelerator.no_sync(model):
                loss = model(input_ids=batch, labels=batch).loss / M
                accelerator.backward(loss)
        else:
            loss = model(input_ids=batch, labels=batch).loss / M
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return model, handle, losses, type(accelerator).__name__


results: dict = {}
for run in args.runs:
    counter.take()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = accel_gradsync.GradSyncConfig(**run["config"])
        try:
            if run["entry"] == "trainer":
                out_dir = f"/tmp/sharded-{os.getpid()}"
                model, handle, losses, hooked_as = train_with_trainer(config, out_dir, run.get("lora", False))
            elif run["entry"] == "grpo":
                model, handle, losses, hooked_as = train_with_grpo(config, f"/tmp/sharded-{os.getpid()}")
            else:
                model, handle, losses, hooked_as = train_with_loop(config)
        except ValueError as error:  # a run the plugin must refuse before any gradient is reduced
            results[run["name"]] = {"error": str(error), "counts": counter.take()}
            continue
    counts = counter.take()
    stats = handle.stats()
    handle.detach()
    results[run["name"]] = {
        "counts": counts,
        "stats": {k: v for k, v in stats.items() if k != "models"},
        "decision": handle.describe(),
        "losses": losses,
        "weights": full_weights(model),
        "hooked_as": hooked_as,
        "trainable_tensors": sum(p.requires_grad for p in model.parameters()),
        "warnings": [str(w.message) for w in caught if "accel_gradsync" in str(w.message)],
    }
write_result(args.out, {"runs": results})
