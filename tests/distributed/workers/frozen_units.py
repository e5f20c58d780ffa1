"""LoRA over a frozen base under FSDP2 (`keep_frozen_unsharded`): a tiny Qwen2 with PEFT LoRA on
q_proj and v_proj (decoder layers as units), an SGD optimizer built before `prepare`, attach
before `prepare`, then STEPS optimizer steps of M causal-LM micro-batches under
`accelerator.accumulate`, clipping at each step. Each run names its GradSyncConfig, and may
unfreeze a base layer's MLP before step `unfreeze_at` or take the whole state dict before step
`state_dict_at`, save the state before step `save_at` and load it back before step `load_at`,
fail a forward before micro-batch `raise_at` ([step, k]), generate as TRL does (forwards without
gradients inside the first micro-batch's `accumulate()`) in step `generate_at` (or between steps,
in eval mode, before step `evaluate_at`), merge the adapter as TRL's vLLM weight sync does before
step `merge_at` (after `grad_sync.reshard_frozen()` unless `reshard` is false), or call
`grad_sync.reshard_frozen()` inside the window, before micro-batch `reshard_at` ([step, k]). A
run with `counts` (per step, each rank's micro-batch count) runs each step inside
`grad_sync.step(n)` (`style` `step`), or pads every rank to the step's largest count with
micro-batches of loss x 0 (`style` `pad`, the reference); each micro-batch's loss counts 1 / the
largest. `attach_after_prepare` (attach after `prepare`: the refusal, or what attach printed and
the units), `refused` (at attach: FSDP1) and `use_vllm` (a Trainer with TRL's
GRPOConfig(use_vllm=True)) report the refusal.

Reported per run: per step the all-gathers (calls, and the bytes of their outputs) counted from
outside by wrapping torch.distributed, the losses; the final parameters (full tensors); the
FSDP2 units with their trainable and frozen parameter counts; the decision line; whether every
unit's flags are back after detach; and, after detach, whether the parameters are sharded again.
A run that generates also reports the logits of its generation forwards and how many of them ran
FSDP2's own pre- and post-forward on a unit with no trainable parameter (FSDP2's record of
post-forwards, one entry per param group per forward it ran them on)."""

import contextlib
import io
import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, tiny_qwen2_config, write_result
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FSDPModule
from transformers import Qwen2ForCausalLM, Trainer
from trl import GRPOConfig

import accel_gradsync

VOCAB, SEQ, B, STEPS = 32, 8, 2, 3
TOKENS = 4  # generation forwards in a step that generates
UNEVEN_DATA = torch.randint(1, VOCAB, (STEPS, 4, 2, B, SEQ), generator=torch.Generator().manual_seed(4))
"""Runs with `counts` (up to 4 micro-batches per rank and step): the micro-batches of 2 ranks."""

args = parse_args([(("--runs",), {"type": json.loads, "required": True}), (("--M",), {"type": int, "default": 2})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
gathered_bytes = [0]
_all_gather_single = dist.all_gather_single


def _counted(output, *a, **k):
    gathered_bytes[0] += output.numel() * output.element_size()
    return _all_gather_single(output, *a, **k)


dist.all_gather_single = _counted  # the bytes each all-gather brings together, on top of the counter
accelerator = Accelerator(gradient_accumulation_steps=args.M)
rank, M = accelerator.process_index, args.M
DATA = torch.randint(
    1, VOCAB, (STEPS, M, accelerator.num_processes, B, SEQ), generator=torch.Generator().manual_seed(3)
)


def units(model) -> dict[str, list[int]]:
    """Each FSDP2 unit (by the name of its first module) with the trainable and frozen parameters
    it manages, read from FSDP2's own param group."""
    out, seen = {}, set()
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        if state is None or id(state) in seen or state._fsdp_param_group is None:
            continue
        seen.add(id(state))
        flags = [p.sharded_param.requires_grad for p in state._fsdp_param_group.fsdp_params]
        out[name] = [sum(flags), len(flags) - sum(flags)]
    return out


def frozen_forward_records(model) -> int:
    """Entries of FSDP2's record of post-forwards (kept for backward prefetching, cleared by the
    last backward) whose param group trains nothing."""
    root = next(m for m in model.modules() if isinstance(m, FSDPModule))
    order = root._get_fsdp_state()._comm_ctx.post_forward_order
    return sum(1 for group in order if not any(p.sharded_param.requires_grad for p in group.fsdp_params))


def generate(model, prompt) -> tuple[list, int]:
    """TOKENS forwards without gradients of a growing sequence, as decoding runs them: the greedy
    tokens' logits, and the frozen param groups' FSDP2 post-forward records they added."""
    before, logits = frozen_forward_records(model), []
    with torch.no_grad():
        for _ in range(TOKENS):
            last = model(input_ids=prompt).logits[:, -1]
            logits.append(last.tolist())
            prompt = torch.cat([prompt, last.argmax(-1, keepdim=True)], dim=1)
    return logits, frozen_forward_records(model) - before


def _raise(*_):
    raise RuntimeError("a forward that fails")


def merged_weights(model, handle, reshard: bool) -> dict:
    """`grad_sync.reshard_frozen()` (unless `reshard` is false), then TRL's FSDP2 weight sync
    (trl/generation/vllm_generation.py): merge the adapter into the sharded base, read every base
    parameter whole, unmerge. The weights read, by name; or the error merging raised."""
    if reshard:
        handle.reshard_frozen()
    try:
        model.merge_adapter()
    except RuntimeError as e:
        return {"error": str(e)}
    weights = {n: p.full_tensor().tolist() for n, p in model.named_parameters() if "lora_" not in n}
    model.unmerge_adapter()
    return weights


def vllm_trainer(model, config) -> dict:
    """attach() on a Trainer whose arguments are TRL's GRPOConfig with `use_vllm` (the Trainer
    itself is transformers': TRL's GRPOTrainer would start vLLM): the refusal, or what auto
    resolved `keep_frozen_unsharded` to."""
    grpo_args = GRPOConfig(
        output_dir=os.path.join(args.out, "vllm"),
        use_vllm=True,
        use_cpu=True,
        bf16=False,  # the launch's precision (GRPOConfig's default is bf16)
        per_device_train_batch_size=2,
        num_generations=2,
        report_to=[],
        accelerator_config={"use_configured_state": True},
    )
    trainer = Trainer(model=model, args=grpo_args)
    try:
        handle = accel_gradsync.attach(trainer, config)
    except ValueError as e:
        accelerator.gradient_accumulation_steps = args.M
        return {"error": str(e)}
    kept = handle.settings.keep_frozen_unsharded
    handle.detach()
    accelerator.gradient_accumulation_steps = args.M  # the Trainer's Accelerator reset the shared GradientState
    return {"keep_frozen_unsharded": kept}


def uneven_step(run: dict, model, optimizer, handle, step: int, losses: list) -> None:
    """One optimizer step of `run["counts"][step][rank]` micro-batches: inside `grad_sync.step(n)`,
    or padded to the largest count with loss x 0 (the reference)."""
    counts = run["counts"][step]
    n, most = counts[rank], max(counts)
    padded = run["style"] == "pad"
    accelerator.gradient_accumulation_steps, accelerator.step = most, 0
    block = contextlib.nullcontext() if padded else handle.step(n)
    with block:
        for k in range(most if padded else n):
            batch = UNEVEN_DATA[step, min(k, n - 1), rank]
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                scale = accelerator.gradient_accumulation_steps / most * (k < n)  # accelerate divides by it
                accelerator.backward(loss * scale)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
    accelerator.gradient_accumulation_steps = args.M


def one_run(run: dict) -> dict:
    set_seed(0)
    base = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=VOCAB, pad_token_id=0))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the adapters something to carry
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # before prepare; frozen ones step once unfrozen
    config = accel_gradsync.GradSyncConfig(**run["config"])
    if run.get("use_vllm"):  # TRL's vLLM weight sync merges the adapter into the sharded base
        return vllm_trainer(model, config)
    if run.get("refused"):  # refused at attach, before anything is prepared
        try:
            accel_gradsync.attach(accelerator, config)
        except ValueError as e:
            return {"error": str(e)}
        raise AssertionError(f"{run['name']} was not refused")
    if run.get("attach_after_prepare"):  # too late to give the adapters units of their own: true refused
        model, optimizer = accelerator.prepare(model, optimizer)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                handle = accel_gradsync.attach(accelerator, config)
        except ValueError as e:
            accelerator.free_memory()
            return {"error": str(e)}
        out = {"printed": printed.getvalue(), "units": units(model), "decision": handle.describe()}
        handle.detach()
        accelerator.free_memory()
        return out
    handle = accel_gradsync.attach(accelerator, config)
    model, optimizer = accelerator.prepare(model, optimizer)
    out: dict = {"units": units(model), "decision": handle.describe(), "steps": []}
    model.train()
    for step in range(STEPS):
        if run.get("unfreeze_at") == step:  # progressive unfreezing of a base layer, at a step boundary
            for p in model.base_model.model.model.layers[1].mlp.parameters():
                p.requires_grad_(True)
        if run.get("state_dict_at") == step:  # a save between steps: FSDP2's hooks reshard every unit
            accelerator.get_state_dict(model)
        if run.get("merge_at") == step:  # what TRL's vLLM weight sync does between steps
            out["merged"] = merged_weights(model, handle, run.get("reshard", True))
            if "error" in out["merged"]:
                handle.detach()
                accelerator.free_memory()
                return out["merged"]
        if run.get("save_at") == step:
            accelerator.save_state(os.path.join(args.out, run["name"]))
        if run.get("load_at") == step:  # back to the checkpoint taken at `save_at`: the adapters revert
            accelerator.load_state(os.path.join(args.out, run["name"]))
        counter.take()
        gathered_bytes[0] = 0
        losses = []
        if run.get("evaluate_at") == step:  # an evaluation between steps: forwards without gradients, eval mode
            model.eval()
            out["evaluated"], out["frozen_forward_records"] = generate(model, DATA[step, 0, rank][:, :2])
            model.train()
        if "counts" in run:  # per-rank counts: the step runs there, the loop below runs none
            uneven_step(run, model, optimizer, handle, step, losses)
        for k in range(0 if "counts" in run else M):
            if run.get("reshard_at") == [step, k]:  # grad_sync.reshard_frozen() inside the window
                handle.reshard_frozen()
            if run.get("raise_at") == [step, k]:  # a forward that fails in its second decoder layer
                fail = model.base_model.model.model.layers[1].register_forward_pre_hook(_raise)
                try:
                    with accelerator.accumulate(model):
                        model(input_ids=DATA[step, k, rank], labels=DATA[step, k, rank])
                except RuntimeError:
                    pass  # the loop goes on with its next micro-batch
                fail.remove()
            with accelerator.accumulate(model):
                batch = DATA[step, k, rank]
                if run.get("generate_at") == step and k == 0:  # TRL generates inside the first micro-batch
                    out["generated"], out["frozen_forward_records"] = generate(model, batch[:, :2])
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        counts = counter.take()
        out["steps"].append(
            {"all_gathers": counts.get("all_gather_single", 0), "gathered_bytes": gathered_bytes[0], "losses": losses}
        )
    kept = ("units_resident", "resident_param_bytes", "units_frozen", "replayed_micro_batches", "evened_micro_batches")
    out["stats"] = {k: handle.stats()[k] for k in kept}
    handle.detach()  # kept units are unsharded until here: their params plain tensors
    out["params"] = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    out["sharded_after_detach"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
    accelerator.free_memory()
    return out


write_result(args.out, {"runs": {run["name"]: one_run(run) for run in args.runs}})
