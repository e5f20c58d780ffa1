"""docs/modes.md's `join()` loop, runnable: a tiny Qwen2 (random weights) trained on a dataset
whose last shard is uneven, so one rank runs more micro-batches than the other, under deferred
gradient sync.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml examples/uneven_inputs.py

On a machine with no GPU/NPU, `enable_cpu_fsdp()` makes that launch real FSDP2 over gloo on the
config's 2 processes. 30 sequences, 2 per micro-batch and rank, without accelerate's even batches:
8 micro-batches on rank 0, 7 on rank 1; 4 per optimizer step, so 2 steps. Without `join()` rank 0
would wait forever in its eighth micro-batch's all-gather; inside it rank 1 shadows that
micro-batch with loss x 0. Each rank prints its count of batches and its counters at the end.
"""

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

import accel_gradsync
from accel_gradsync import GradSyncConfig

VOCAB, SEQUENCES, TOKENS, BATCH_SIZE, ACCUMULATION_STEPS = 64, 30, 16, 2, 4

torch.manual_seed(0)  # the same weights on every rank (FSDP on CPU cannot broadcast rank 0's)
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
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=2)
tokens = torch.randint(0, VOCAB, (SEQUENCES, TOKENS))
loader = DataLoader([{"input_ids": t, "labels": t} for t in tokens], batch_size=BATCH_SIZE)

accel_gradsync.enable_cpu_fsdp()  # real FSDP over gloo on a machine with no GPU/NPU; a no-op elsewhere
accelerator = Accelerator(
    dataloader_config=DataLoaderConfiguration(even_batches=False),  # the last shard stays uneven
    # join() needs each rank's last window ended by the count, not by its own DataLoader's end.
    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=ACCUMULATION_STEPS, sync_with_dataloader=False),
)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

grad_sync = accel_gradsync.attach(accelerator, GradSyncConfig(defer=True))
with grad_sync.join():
    for batch in loader:  # a different number of batches on each rank
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
counts = ("micro_batches", "optimizer_steps", "reduce_scatters_issued", "reduce_scatters_skipped")
stats = grad_sync.stats()  # all of them, and the last step alone under "last_step/..."
print(f"rank {accelerator.process_index}: {len(loader)} batches, {dict((name, stats[name]) for name in counts)}")
