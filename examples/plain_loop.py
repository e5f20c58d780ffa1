"""The README's plain `accelerator.accumulate` loop, runnable: a tiny Qwen2 (random weights, built
from its config), AdamW and a DataLoader of random tokens, trained with deferred gradient sync.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml examples/plain_loop.py

On a machine with no GPU/NPU, `enable_cpu_fsdp()` makes that launch real FSDP2 over gloo on the
config's 2 processes; on a GPU/NPU node set the config's `num_processes` to the device count.
32 sequences, 2 per micro-batch and process, 4 micro-batches per optimizer step: 2 optimizer
steps. At bind, the main process prints the decision line; at the end, every rank its counters.
"""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

from accel_gradsync import GradSyncConfig, attach, enable_cpu_fsdp

VOCAB, SEQUENCES, TOKENS = 64, 32, 16

# Every rank builds the same weights from the same seed (FSDP on CPU cannot broadcast rank 0's).
torch.manual_seed(0)
config = Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # 2 Qwen2DecoderLayer units (the config's wrap class) and the root: 3 FSDP units
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=TOKENS,
    tie_word_embeddings=True,
)
model = Qwen2ForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, VOCAB, (SEQUENCES, TOKENS))
loader = DataLoader([{"input_ids": t, "labels": t} for t in tokens], batch_size=2)

enable_cpu_fsdp()  # real FSDP over gloo on a machine with no GPU/NPU; a no-op elsewhere
accelerator = Accelerator(gradient_accumulation_steps=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
grad_sync = attach(accelerator, GradSyncConfig(defer=True))
for batch in loader:
    with accelerator.accumulate(model):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
counts = ("micro_batches", "deferred_micro_batches", "reduce_scatters_issued", "reduce_scatters_skipped")
accelerator.print({name: grad_sync.stats()[name] for name in counts})  # all of them: grad_sync.stats()
