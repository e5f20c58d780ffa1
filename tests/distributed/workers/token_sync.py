"""transformers' `generate` on a tiny Qwen2 under FSDP2 (decoder layers as units), with each rank
asking for a different number of new tokens (rank r: 3 + 4r), then M micro-batches of training on
what it generated, for 2 steps. Each run names a sync config, where generation happens (before the
window, or inside its first micro-batch as in TRL) and the `synced_gpus` the caller passes (unset:
transformers' default). Reported per step: the all-reduces issued during `generate` (counted from
outside, by wrapping torch.distributed), the all-gathers, the tokens, the losses; per run whether
the model's `generate` is back to what it was before attach after detach, and a fingerprint of
the rank's random state after each generation. `collective_in_forward`: the first decoder layer
all-reduces at every forward, as a tensor-parallel layer would. `dropout`: the model's attention
dropout, active where it generates in train mode (as TRL does; `eval`: generation in eval mode,
training in train mode). `lora_dropout`: the model under PEFT LoRA (q_proj, v_proj) with that
dropout, the base frozen. `counts` (per rank): each step is `grad_sync.step(counts[rank])` with
that many micro-batches; `join`: the steps run inside `grad_sync.join()`, rank r running r + 1 of
them. A ValueError is left to end the process (the launcher then stops the other rank)."""

import contextlib
import hashlib
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, tiny_qwen2_config, train_lm_micro_batch, write_result
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers import Qwen2ForCausalLM

import accel_gradsync

VOCAB, PROMPT, B = 32, 4, 2

args = parse_args([(("--runs",), {"type": json.loads, "required": True}), (("--M",), {"type": int, "default": 2})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=args.M)
rank, M, STEPS = accelerator.process_index, args.M, 2
TOKENS = 3 + 4 * rank
PROMPTS = torch.randint(
    1, VOCAB, (STEPS, accelerator.num_processes, M * B, PROMPT), generator=torch.Generator().manual_seed(5)
)


def one_run(run: dict) -> dict:
    set_seed(0)
    config = tiny_qwen2_config(
        vocab_size=VOCAB,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        attention_dropout=run.get("dropout", 0.0),
    )
    model = Qwen2ForCausalLM(config)
    if "lora_dropout" in run:  # PEFT's dropout on each adapter's input: drawn at every forward, whatever the cache
        lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=run["lora_dropout"])
        model = get_peft_model(model, lora)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if run.get("collective_in_forward"):  # a collective of the model's own at every forward, as tensor parallel
        model.model.layers[0].register_forward_hook(lambda module, args, out: dist.all_reduce(torch.zeros(1)))
    model, optimizer = accelerator.prepare(model, optimizer)
    if "lora_dropout" in run:  # PEFT's generate forwards the inner model: FSDP2's root runs first, as TRL has it
        register_fsdp_forward_method(model, "generate")
    own_generate = vars(model).get("generate")
    handle = accel_gradsync.attach(accelerator, accel_gradsync.GradSyncConfig(**run["config"]))
    extra = {"synced_gpus": run["synced_gpus"]} if "synced_gpus" in run else {}
    out: dict = {"steps": []}

    def generate(prompts: torch.Tensor) -> tuple[torch.Tensor, dict]:
        counter.take()
        model.train(not run.get("eval"))
        ids = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=TOKENS, do_sample=False, **extra
        )
        model.train()
        counts = counter.take()
        gathers = sum(n for name, n in counts.items() if "all_gather" in name)
        rng = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
        return ids, {"all_reduces": counts.get("all_reduce", 0), "all_gathers": gathers, "rng": rng}

    model.train()
    joined = handle.join() if run.get("join") else contextlib.nullcontext()
    with joined:
        train(run, handle, model, optimizer, generate, out, steps=rank + 1 if run.get("join") else STEPS)
    handle.detach()
    out["generate_restored"] = vars(model).get("generate") is own_generate
    accelerator.free_memory()
    return out


def train(run: dict, handle, model, optimizer, generate, out: dict, steps: int) -> None:
    """`steps` optimizer steps of M micro-batches (step(n)'s n with `counts`), generating where
    `run["at"]` says; each step's record appended to `out["steps"]`."""
    for step in range(steps):
        record: dict = {"losses": []}
        n = run["counts"][rank] if "counts" in run else M
        with handle.step(n) if "counts" in run else contextlib.nullcontext():
            if run["at"] == "outside":
                ids, record["generate"] = generate(PROMPTS[step, rank])
            for k in range(n):
                with accelerator.accumulate(model):
                    if k == 0 and run["at"] == "inside":
                        ids, record["generate"] = generate(PROMPTS[step, rank])
                    batch = ids[k * B : (k + 1) * B]
                    record["losses"].append(train_lm_micro_batch(accelerator, model, optimizer, batch))
        record["completions"] = ids[:, PROMPT:].tolist()
        out["steps"].append(record)


write_result(args.out, {"tokens": TOKENS, "runs": {run["name"]: one_run(run) for run in args.runs}})
