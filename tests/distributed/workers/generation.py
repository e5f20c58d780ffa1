"""Generate, then train on what was generated, as GRPO does: a tiny Qwen2 under FSDP2 (decoder
layers as units), T greedy tokens once per optimizer step, then M micro-batches of
causal-LM loss on the completions under `accelerator.accumulate`. Each run names its sync
config, where generation happens (before the window, or inside its first micro-batch as in
TRL), the model (plain, PEFT LoRA, or a frozen root) and an optional exception.

Reported per step: all-gathers and reduce-scatters counted from outside during generation and
during training, the handle's counters over the same spans, completions, losses, and the
largest parameter difference to an earlier run named by `compare_to` (kept in memory here)."""

import contextlib
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, tiny_qwen2_config, write_result
from torch.distributed.fsdp import FSDPModule
from transformers import Qwen2ForCausalLM

import accel_gradsync
from accel_gradsync.fsdp import sync_flags

VOCAB, PROMPT, B = 32, 4, 2

args = parse_args(
    [
        (("--runs",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 2}),
        (("--steps",), {"type": int, "default": 2}),
        (("--tokens",), {"type": int, "default": 5}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
N, M, T = accelerator.num_processes, args.M, args.tokens
rank = accelerator.process_index
g = torch.Generator().manual_seed(5)
PROMPTS = torch.randint(1, VOCAB, (args.steps, N, M * B, PROMPT), generator=g)
GATHERS = ("all_gather_single", "all_gather_into_tensor")
REDUCES = ("reduce_scatter_single", "reduce_scatter_tensor")


def build(kind: str) -> torch.nn.Module:
    set_seed(0)
    config = tiny_qwen2_config(vocab_size=VOCAB, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zeros by default: the first steps would change nothing
                torch.nn.init.normal_(p, std=0.05)
    elif kind == "frozen_root":  # embeddings (tied head) and final norm frozen: the root unit reduces nothing
        model.model.embed_tokens.requires_grad_(False)
        model.model.norm.requires_grad_(False)
    return model


def greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    """T greedy tokens, one forward of the whole sequence each (no cache): the root's forward runs
    every time, which PEFT's own `generate` skips (FSDP2 must then find the root unsharded)."""
    ids = prompts
    for _ in range(T):
        logits = model(input_ids=ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def gathers(counts: dict) -> int:
    return sum(counts.get(n, 0) for n in GATHERS)


def reduces(counts: dict) -> int:
    return sum(counts.get(n, 0) for n in REDUCES)


def all_sharded(model) -> bool:
    """No FSDP2 unit holds its unsharded params (read as the accumulate worker does)."""
    return all(
        g.is_sharded
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    )


def flags(model) -> dict:
    """Every FSDP2 unit's (requires_gradient_sync, requires_all_reduce, reshard_after_backward) and
    reshard_after_forward, as FSDP2 keeps them (no public getters)."""
    after_forward = {
        n: [g.post_forward_mesh_info is not None for g in m._get_fsdp_state()._fsdp_param_groups]
        for n, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }
    return {"sync": {n: list(f) for n, f in sync_flags(model).items()}, "after_forward": after_forward}


def full_params(model) -> dict:
    with counter.paused():
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


class Raiser:
    """A forward hook on the last decoder layer that raises on its `at`-th call without gradients."""

    def __init__(self, model, at: int) -> None:
        layers = [m for n, m in model.named_modules() if type(m).__name__.endswith("Qwen2DecoderLayer")]
        self.calls, self.at = 0, at
        self.handle = layers[-1].register_forward_hook(self)

    def __call__(self, module, args, output):
        if not torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError("generation failed")


snapshots: dict[str, list] = {}
result: dict = {"runs": {}}


def one_run(run: dict) -> dict:
    """Train `run` for `--steps` steps; its report."""
    model = build(run.get("model", "plain"))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    with torch.no_grad():  # FSDP2's lazy init (it sets the root's flags), before the flags are read
        model(input_ids=PROMPTS[0, rank])
    for module in model.modules():  # the root's units stay gathered after a forward: start sharded
        if isinstance(module, FSDPModule):
            module.reshard()
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    flags_before = flags(model)
    generate_at = run.get("generate_at", "outside")
    out: dict = {"steps": [], "decision": handle.describe(), "units": len(handle.units())}
    out["frozen_units"] = sum(u.frozen for u in handle.units())
    params, stats = [], handle.stats

    def generate(prompts):
        """One generation round; returns completions and (outside gathers, stats' generation gathers)."""
        counter.take()
        before = stats()["generation_all_gathers"]
        context = handle.gathered(model) if run.get("gathered") else contextlib.nullcontext()
        with torch.no_grad(), context:
            ids = greedy(model, prompts)
            if run.get("raise") == "between" and not out.get("raised"):
                out["raised"] = True
                raise RuntimeError("generation failed after its forwards")
        return ids, gathers(counter.take()), stats()["generation_all_gathers"] - before

    def try_generate(prompts):
        """`raise` runs: the first round fails (in a forward, or after the forwards) and is caught."""
        if run.get("raise") == "forward" and not out.get("raised"):
            out["raised"] = True
            raiser = Raiser(model, at=3)
            with contextlib.suppress(RuntimeError):
                generate(prompts)
            raiser.handle.remove()
            out["sharded_after_raise"] = all_sharded(model)
        elif run.get("raise") == "between" and not out.get("raised"):
            try:
                generate(prompts)
            except RuntimeError:
                out["sharded_after_raise"] = all_sharded(model)
        return generate(prompts)

    model.train()
    if run.get("raise") == "accumulate":  # generation inside a window's first micro-batch fails: accumulate aborts
        try:
            with accelerator.accumulate(model):
                with torch.no_grad():
                    greedy(model, PROMPTS[0, rank])
                raise RuntimeError("reward function failed")
        except RuntimeError:
            out["sharded_after_raise"] = all_sharded(model)
    model.train()
    for step in range(args.steps):
        prompts = PROMPTS[step, rank]
        record: dict = {"losses": []}
        if generate_at == "outside":
            ids, record["gen_outside"], record["gen_stats"] = try_generate(prompts)
        before = stats()
        counter.take()
        train_gathers = 0
        for k in range(M):
            with accelerator.accumulate(model):
                if k == 0 and generate_at == "inside":
                    train_gathers += gathers(counter.take())
                    gen_stats_before = stats()["generation_all_gathers"]
                    ids, record["gen_outside"], record["gen_stats"] = try_generate(prompts)
                    before["generation_all_gathers"] += stats()["generation_all_gathers"] - gen_stats_before
                batch = ids[k * B : (k + 1) * B]
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                record["losses"].append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
        counts = counter.take()
        after = stats()
        record["train_outside"] = train_gathers + gathers(counts)
        record["reduce_scatters_outside"] = reduces(counts)
        record["train_stats"] = after["all_gathers"] - before["all_gathers"]
        record["gen_stats_in_train"] = after["generation_all_gathers"] - before["generation_all_gathers"]
        record["reduce_scatters_stats"] = after["reduce_scatters_issued"] - before["reduce_scatters_issued"]
        record["completions"] = ids[:, PROMPT:].tolist()
        record["sharded_after_step"] = all_sharded(model)
        params.append(full_params(model))
        out["steps"].append(record)
    snapshots[run["name"]] = params
    if "compare_to" in run:
        ref = snapshots[run["compare_to"]]
        out["param_diff"] = max((a[n] - b[n]).abs().max().item() for a, b in zip(params, ref, strict=True) for n in a)
    out["stats"] = handle.stats()
    out["flags_restored"] = flags(model) == flags_before
    handle.detach()
    accelerator.free_memory()
    return out


for run in args.runs:
    result["runs"][run["name"]] = one_run(run)
write_result(args.out, result)
