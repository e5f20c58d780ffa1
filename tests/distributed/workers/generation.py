"""Generate, then train on what was generated, as GRPO does: a tiny Qwen2 under FSDP2 (decoder
layers as units), T greedy tokens once per optimizer step, then M micro-batches of
causal-LM loss on the completions under `accelerator.accumulate`. Each run names its sync
config, where generation happens (before the window, or inside its first micro-batch as in
TRL, or inside a caller's `except` block), the model (plain, PEFT LoRA, a frozen root, compiled,
or beside a second bound model) and an optional exception. Trainer runs train the same model with
transformers' `Trainer` (prepared by accelerate, or sharded at load time by transformers from
`--model`), evaluating after every step, and may fail inside its `no_sync`.

Reported per step: all-gathers and reduce-scatters counted from outside during generation and
during training, the handle's counters over the same spans, completions, losses, and the
largest parameter difference to an earlier run named by `compare_to` (kept in memory here)."""

import contextlib
import io
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, sync_flags, tiny_qwen2_config, train_lm_micro_batch, write_result
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import Qwen2ForCausalLM

import accel_gradsync
from accel_gradsync.runtime.wrappers.adapt import adapt_model

VOCAB, PROMPT, B = 32, 4, 2

args = parse_args(
    [
        (("--runs",), {"type": json.loads, "required": True}),
        (("--M",), {"type": int, "default": 2}),
        (("--steps",), {"type": int, "default": 2}),
        (("--tokens",), {"type": int, "default": 5}),
        # A saved tiny Qwen2 for the Trainer runs with "load": "transformers" (DistributedConfig).
        (("--model",), {"default": None}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
N, M, T = accelerator.num_processes, args.M, args.tokens
rank = accelerator.process_index
g = torch.Generator().manual_seed(5)
PROMPTS = torch.randint(1, VOCAB, (args.steps, N, M * B, PROMPT), generator=g)
SEQUENCES = torch.randint(1, VOCAB, (args.steps * N * M * B, PROMPT + T), generator=g)  # the Trainer runs' data
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


def start_sharded(model) -> None:
    """FSDP2's lazy init (it sets the root's flags) before the flags are read, then every unit
    sharded: the root's units stay gathered after a forward."""
    with torch.no_grad():
        model(input_ids=PROMPTS[0, rank])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    """T greedy tokens, one forward of the whole sequence each (no cache): the root's forward runs
    every time, which PEFT's own `generate` skips (FSDP2 must then find the root unsharded)."""
    ids = prompts
    for _ in range(T):
        logits = model(input_ids=ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def forward_records(model) -> int:
    """How many post-forwards FSDP2 has recorded since the last backward (one per param group per
    forward it runs its hooks on; generation runs no backward)."""
    return len(adapt_model(model).fsdp_root()._get_fsdp_state()._comm_ctx.post_forward_order)


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


def units_sharded(model, given: dict) -> bool:
    """Every FSDP2 unit that reshards after forward by the flags it was given (`given`, as
    `flags()` read them while nothing was kept) holds no unsharded params. The others (the root,
    units a wrap policy keeps) stay gathered after a forward by FSDP's own choice."""
    return all(
        g.is_sharded
        for n, m in model.named_modules()
        if isinstance(m, FSDPModule)
        for g, reshards in zip(m._get_fsdp_state()._fsdp_param_groups, given["after_forward"][n], strict=True)
        if reshards
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
    """By the name the uncompiled model gives each parameter. A unit FSDP left unsharded (the root
    after an evaluation) has its whole parameters registered instead of the sharded DTensors."""
    with counter.paused():
        return {
            n.replace("_orig_mod.", ""): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()
        }


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
    if run.get("compiled"):  # accelerate's dynamo_backend compiles before fully_shard, as here
        model = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    if run.get("other"):  # a second bound model, never stepped (accelerate's FSDP2 prepares one with an optimizer)
        other = build("plain")
        other, _ = accelerator.prepare(other, torch.optim.SGD(other.parameters(), lr=0.0))
        start_sharded(other)
        other_flags = flags(other)
    start_sharded(model)
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    flags_before = flags(model)
    generate_at = run.get("generate_at", "outside")
    out: dict = {"steps": [], "decision": handle.describe(), "units": len(handle.units())}
    out["frozen_units"] = sum(u.frozen for u in handle.units())
    out["model_names"] = list(handle.stats()["models"])
    params = []

    def stats() -> dict:
        """The trained model's own counters (the first bound)."""
        return handle.stats()["models"][out["model_names"][0]]

    def generate(prompts):
        """One generation round; returns completions and (outside gathers, stats' generation gathers)."""
        counter.take()
        before = stats()["generation_all_gathers"]
        context = handle.gathered(model) if run.get("gathered") else contextlib.nullcontext()
        records = forward_records(model)
        with torch.no_grad(), context:
            ids = greedy(model, prompts)
            gen_outside = gathers(counter.take())
            out.setdefault("fsdp_forward_records", []).append(forward_records(model) - records)
            if run.get("other"):  # not the model gathered() names: all-gathers every unit per token
                greedy(other, prompts)
                out.setdefault("other_gathers", []).append(gathers(counter.take()))
                out.setdefault("other_sharded", []).append(units_sharded(other, other_flags))
            if run.get("raise") == "between" and not out.get("raised"):
                out["raised"] = True
                raise RuntimeError("generation failed after its forwards")
        return ids, gen_outside, stats()["generation_all_gathers"] - before

    def try_generate(prompts):
        """`raise` runs: the first round fails (in a forward, or after the forwards) and is caught;
        `in_except` runs generate while handling an earlier failure (a retry after a timeout)."""
        if run.get("in_except"):
            try:
                raise TimeoutError("the first attempt timed out")
            except TimeoutError:
                return generate(prompts)
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
                record["losses"].append(train_lm_micro_batch(accelerator, model, optimizer, batch))
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
    out["stats"] = stats()
    out["flags_restored"] = flags(model) == flags_before
    out["decision_after"] = handle.describe()
    handle.detach()
    accelerator.free_memory()
    return out


def trainer_run(run: dict) -> dict:
    """Train with transformers' `Trainer`, evaluating after every optimizer step (the last one
    too). `raise`: the first micro-batch fails after its backward, inside the Trainer's `no_sync`
    (a check on the loss, an OOM the Trainer's `auto_find_batch_size` retries), and is caught."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    out: dict = {"sharded_after_evaluate": []}
    if run.get("load") == "transformers":  # sharded at load time: the Trainer's own deferral path
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        set_seed(0)
        model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(fsdp_size=N))
        configured = {}
    else:
        model, configured = build("plain"), {"accelerator_config": {"use_configured_state": True}}

    class Watch(TrainerCallback):
        """After the plugin's callback (it goes first): what it left."""

        def on_train_begin(self, args_, state, control, **kw):
            out["sync_flags"] = sync_flags(trainer.model_wrapped)

        def on_step_end(self, args_, state, control, **kw):
            # FSDP2 initialised, the window ended, the optimizer stepped: the flags each unit was given.
            out.setdefault("flags", flags(trainer.model_wrapped))

        def on_evaluate(self, args_, state, control, **kw):
            out["sharded_after_evaluate"].append(units_sharded(trainer.model_wrapped, out["flags"]))

    class FailingTrainer(Trainer):
        def training_step(self, *step_args, **kw):
            loss = super().training_step(*step_args, **kw)
            if run.get("raise") and "held_before_raise" not in out:
                out["held_before_raise"] = adapt_model(self.model_wrapped).held_grad_bytes()
                raise RuntimeError("the loss check after backward failed")
            return loss

    training = TrainingArguments(
        output_dir=f"/tmp/generation-trainer-{os.getpid()}",
        per_device_train_batch_size=B,
        per_device_eval_batch_size=B,
        gradient_accumulation_steps=M,
        max_steps=args.steps,
        eval_strategy="steps",
        eval_steps=1,
        learning_rate=0.5,
        optim="sgd",
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        **configured,
    )
    data = [{"input_ids": s, "labels": s} for s in SEQUENCES]
    trainer = FailingTrainer(model=model, args=training, train_dataset=data, eval_dataset=data[: 2 * B * N])
    trainer.add_callback(Watch())
    handle = accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(**run["config"]))
    try:
        trainer.train()
    except RuntimeError:
        out["held_after_raise"] = adapt_model(trainer.model_wrapped).held_grad_bytes()
    if "flags" in out:  # an optimizer step ran
        out["sharded_after_train"] = units_sharded(trainer.model_wrapped, out["flags"])
        out["flags_restored"] = flags(trainer.model_wrapped) == out.pop("flags")
    out["sync_flags_restored"] = sync_flags(trainer.model_wrapped) == out["sync_flags"]
    out["eval_losses"] = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    out["stats"] = handle.stats()
    params = [full_params(trainer.model_wrapped)]
    snapshots[run["name"]] = params
    if "compare_to" in run:
        ref = snapshots[run["compare_to"]]
        out["param_diff"] = max((a[n] - b[n]).abs().max().item() for a, b in zip(params, ref, strict=True) for n in a)
    handle.detach()
    return out


for run in args.runs:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # what the plugin prints (on the main process)
        result["runs"][run["name"]] = trainer_run(run) if run.get("entry") == "trainer" else one_run(run)
    print(printed.getvalue(), end="")
    result["runs"][run["name"]]["printed"] = [line for line in printed.getvalue().splitlines() if "grad sync" in line]
write_result(args.out, result)
