"""The recipe's built-in defaults, so `recipes/grpo.py` trains on a fresh machine with no hub access:
a character-level tokenizer built with `tokenizers`, a tiny Qwen2-style causal LM with random
weights, a prompt dataset of additions with verifiable answers, and the reward functions.

From random weights GRPO learns the format and then collapses onto one number printed for every
prompt (every completion of a group scores the same, and the gradient is zero). So `warm_up`
first gives the model two seconds of supervised training: short enough that it leaves most of
the task to GRPO. The warmed-up model knows more than it samples: greedy decoding gets about
two sums in three right, sampling at temperature 1 (what GRPO does) about one in three. GRPO
sharpens the sampled policy towards what the model knows, so the accuracy reward, which counts
exact answers only, rises over the run (0.33 to 0.45 in the default run, docs/recipe.md). Single-digit
operands (100 sums) keep that within reach of 500 steps of 4 prompts each.
"""

from __future__ import annotations

import os
import random
import re
from fractions import Fraction
from typing import Any

import safetensors.torch
import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from accel_gradsync.estimator.inputs import RECIPE_DEFAULT_MODEL

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = "0123456789+-= "


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of `CHARS`, plus pad/eos/unk."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters back together, without WordLevel's spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.padding_side = "left"  # generation appends on the right
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """Random init; every rank gets the same weights because the caller seeds first (CPU FSDP
    cannot broadcast rank 0's weights, see accel_gradsync/compat/cpu.py)."""
    config = Qwen2Config(**{k: v for k, v in RECIPE_DEFAULT_MODEL.items() if k != "model_type"})
    config.architectures = [Qwen2ForCausalLM.__name__]  # what a saved model's config names (see reload_from)
    ids = (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert ids == (config.vocab_size, config.pad_token_id, config.eos_token_id), ids  # one character set
    return Qwen2ForCausalLM(config)


def reload_from(model: Qwen2ForCausalLM, folder: str) -> Qwen2ForCausalLM:
    """`model` saved to `folder` and loaded back: the same weights, with `folder` as its
    `name_or_path`, where TRL's GRPOTrainer loads the reference model from (`beta` > 0: a copy of
    the policy GRPO starts from, built with `from_pretrained` of the policy's `name_or_path`).
    Every rank writes its own folder (`save_pretrained` writes on rank 0 only), so ranks on other
    hosts need no shared file system."""
    model.config.save_pretrained(folder)
    safetensors.torch.save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return Qwen2ForCausalLM.from_pretrained(folder)


def build_dataset(n: int = 2000, max_operand: int = 9, seed: int = 0) -> Dataset:
    """`a+b=` prompts with the sum as answer; the columns every dataset given to the recipe needs."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def warm_up(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int = 1) -> float:
    """Supervised training on `a+b=sum<eos>` texts (another draw of the prompts, seed `seed`),
    batches of 64, AdamW: 100 steps take about 2 s on one core and leave the tiny model right
    about a third of the time when sampling (two thirds greedily); 200 steps would solve the
    task and leave GRPO nothing to learn. Deterministic: every rank computes the same weights.
    Returns the last loss."""
    data = build_dataset(seed=seed)
    texts = [p + a for p, a in zip(data["prompt"], data["answer"], strict=True)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        seqs = [tokenizer(texts[i])["input_ids"] + [eos] for i in torch.randint(len(texts), (64,), generator=generator)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


# -- rewards ----------------------------------------------------------------------------------
# A number as answers write it: an optional minus sign (not one between two numbers, which is an
# operator), digits grouped by thousands separators (`1,234,567`, as GSM8K writes them) or not,
# and an optional decimal part. Digits right after a point belong to the number before it.
_NUMBER = re.compile(r"(?<![\d.])(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def _text(completion: Any) -> str:
    """Plain text of a standard (str) or conversational (list of messages) completion."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def last_number(text: str) -> Fraction | None:
    """The last number in `text`, exactly (`2.5` is 5/2, `1,000` is 1000), or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def accuracy_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1 for the right number (the last number in the completion equals the last in `answer`, as
    numbers: `5.0` is 5, `2.5` is not; GSM8K's `#### 72` works too), else 0. No credit for near
    misses: then its logged mean is the share of right answers, and a run that learns shows it
    (partial credit kept that mean near 0.6 whatever the model did)."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=True):
        pred, target = last_number(_text(completion)), last_number(str(ans))
        rewards.append(1.0 if pred is not None and pred == target else 0.0)
    return rewards


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1 for a bare integer (what the prompts ask for); otherwise half the share of digit characters,
    the first thing a random model can learn."""
    rewards = []
    for completion in completions:
        text = _text(completion).strip()
        if re.fullmatch(r"-?\d{1,6}", text):
            rewards.append(1.0)
        else:
            rewards.append(0.5 * sum(c.isdigit() for c in text) / max(len(text), 1))
    return rewards


REWARD_FUNCS = {"accuracy": accuracy_reward, "format": format_reward}
