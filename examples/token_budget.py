"""docs/modes.md's loop that packs RL rollouts by tokens, runnable: each rank generates its own
completions (a tiny Qwen2 with random weights; each completion cut at its own length, as an
end-of-sequence token would cut it), packs them into micro-batches of at most 64 tokens
(padding included), so each rank runs its own number of micro-batches every step, and trains on
them with a mean loss per completion token over the whole step.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml examples/token_budget.py

On a machine with no GPU/NPU, `enable_cpu_fsdp()` makes that launch real FSDP2 over gloo on the
config's 2 processes. Deferral with every unit windowed makes the counts free: each step issues one
all-gather and one reduce-scatter per unit whatever the counts, and no rank pads. Each rank prints
its count per step and, at the end, its counters.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from transformers import Qwen2Config, Qwen2ForCausalLM

import accel_gradsync
from accel_gradsync import GradSyncConfig

VOCAB, PROMPT_TOKENS, MAX_NEW_TOKENS, STEPS, PROMPTS_PER_STEP = 64, 4, 32, 4, 8


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor  # rollouts padded to the longest
    loss_mask: torch.Tensor  # 1 where a position predicts a completion token
    num_tokens: int  # completion tokens: what the loss is a mean over


def generate(model: torch.nn.Module, prompts: torch.Tensor) -> list[torch.Tensor]:
    """This rank's rollouts: prompt and completion, each completion cut at its own length (1 to
    MAX_NEW_TOKENS, long-tailed: most are short)."""
    with torch.no_grad(), grad_sync.gathered(model):  # each unit all-gathered once, not per token
        sequences = model.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, eos_token_id=None)
    lengths = (2 ** (torch.rand(len(prompts)) * MAX_NEW_TOKENS.bit_length())).long().clamp(1, MAX_NEW_TOKENS)
    return [seq[: PROMPT_TOKENS + int(n)] for seq, n in zip(sequences, lengths, strict=True)]


def pack_by_tokens(rollouts: list[torch.Tensor], token_budget: int) -> list[MicroBatch]:
    """Rollouts, shortest first, in micro-batches of at most `token_budget` tokens once padded."""
    batches, current = [], []
    for rollout in sorted(rollouts, key=len):
        if current and (len(current) + 1) * len(rollout) > token_budget:
            batches.append(micro_batch(current))
            current = []
        current.append(rollout)
    return [*batches, micro_batch(current)]


def micro_batch(rollouts: list[torch.Tensor]) -> MicroBatch:
    input_ids = torch.zeros(len(rollouts), max(map(len, rollouts)), dtype=torch.long)
    loss_mask = torch.zeros(len(rollouts), input_ids.shape[1] - 1)
    for i, rollout in enumerate(rollouts):
        input_ids[i, : len(rollout)] = rollout
        loss_mask[i, PROMPT_TOKENS - 1 : len(rollout) - 1] = 1  # positions that predict the completion
    return MicroBatch(input_ids, loss_mask, int(loss_mask.sum()))


def loss_fn(output, mb: MicroBatch) -> torch.Tensor:
    """Each completion token's loss (a policy-gradient loss weights it by its advantage)."""
    logits = output.logits[:, :-1]
    losses = F.cross_entropy(logits.flatten(0, 1), mb.input_ids[:, 1:].flatten(), reduction="none")
    return losses.view_as(mb.loss_mask) * mb.loss_mask


torch.manual_seed(0)  # the same weights on every rank (FSDP on CPU cannot broadcast rank 0's)
config = Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # 2 Qwen2DecoderLayer units (the config's wrap class) and the root: 3 FSDP units
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=PROMPT_TOKENS + MAX_NEW_TOKENS,
    tie_word_embeddings=True,
)
model = Qwen2ForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=STEPS)

accel_gradsync.enable_cpu_fsdp()  # real FSDP over gloo on a machine with no GPU/NPU; a no-op elsewhere
accelerator = Accelerator()
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
torch.manual_seed(1 + accelerator.process_index)  # each rank its own prompts and completions
prompt_batches = [torch.randint(1, VOCAB, (PROMPTS_PER_STEP, PROMPT_TOKENS)) for _ in range(STEPS)]

grad_sync = accel_gradsync.attach(accelerator, GradSyncConfig(sync_mode="deferred", keep_params_unsharded=True))
for prompts in prompt_batches:  # a plain iterable: a prepared DataLoader would end the window itself
    rollouts = generate(model, prompts)  # this rank's completions, any lengths
    batches = pack_by_tokens(rollouts, token_budget=64)  # this rank's micro-batches, its own count
    with grad_sync.step(len(batches), tokens=sum(b.num_tokens for b in batches)) as step:
        for mb in batches:
            with accelerator.accumulate(model):
                token_loss_sum = loss_fn(model(mb.input_ids), mb).sum()
                # A mean per token over every rank's step: accelerate divides by
                # gradient_accumulation_steps (n here) and FSDP averages over ranks: undo both.
                scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / step.tokens
                accelerator.backward(token_loss_sum * scale)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
    print(f"rank {accelerator.process_index}: {step.micro_batches} of {step.smallest}-{step.largest} micro-batches")
counts = ("micro_batches", "evened_micro_batches", "replayed_micro_batches", "reduce_scatters_issued")
stats = grad_sync.stats()  # all of them, and the last step alone under "last_step/..."
print(f"rank {accelerator.process_index}: {dict((name, stats[name]) for name in counts)}")
