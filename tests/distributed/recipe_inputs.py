"""A saved model directory and local GSM8K-shaped datasets for launching recipes/grpo.py on real
paths, offline: what `--model_name_or_path` and `--dataset_name` are given in the tests.

The model is a tiny Qwen2 with random weights saved with `save_pretrained`, with a character
tokenizer built with `tokenizers` and saved as a `PreTrainedTokenizerFast` next to it (so
`AutoTokenizer`, which GRPOTrainer uses, loads it). The dataset has GSM8K's columns: a
`question`, and an `answer` whose last line is `#### <number>`.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

ROWS = 64  # generation batches of 2 ranks x 4 prompts x 4 micro-batches: a few steps per epoch
DECODER_LAYERS = 2


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, plus pad/eos/unk."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *string.printable])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_model(folder: Path) -> Path:
    """A tiny Qwen2ForCausalLM (random weights, fixed seed) and its tokenizer, saved to `folder`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=DECODER_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gsm8k_rows() -> list[dict]:
    rows = []
    for i in range(ROWS):
        a, b = i % 8, i // 8
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many now?",
                "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}",
            }
        )
    return rows


def save_dataset_folder(folder: Path) -> Path:
    """The rows as a `datasets` `save_to_disk` folder."""
    Dataset.from_list(gsm8k_rows()).save_to_disk(str(folder))
    return folder


def save_dataset_json(path: Path) -> Path:
    """The rows as one JSON file (a list of records)."""
    path.write_text(json.dumps(gsm8k_rows()))
    return path
