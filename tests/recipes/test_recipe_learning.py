"""The default GRPO run learns, not print one fixed number.

Two fast checks of the two things that make it learn (the slow end-to-end check of a whole
default run is `test_the_default_run_learns` in tests/distributed/test_grpo_recipe.py):
the accuracy reward counts right answers only, so its logged mean shows learning; and the
default warm-up leaves the tiny model knowing more than it samples, which is what GRPO's
sharpening of the sampled policy turns into accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

import embedded  # noqa: E402
import grpo  # noqa: E402


def test_accuracy_reward_counts_exact_answers_only():
    completions = ["12", " 12", "13", "11", "1+1=12", "x", ""]
    assert embedded.accuracy_reward(completions, ["12"] * len(completions)) == [1, 1, 0, 0, 1, 0, 0]
    assert embedded.accuracy_reward(["72"], ["so 70+2 is 72\n#### 72"]) == [1.0]  # GSM8K answers


def sampled_and_greedy_accuracy(seed: int, prompts: int = 64) -> tuple[float, float]:
    """The default-warmed-up model's accuracy on the default prompts: sampled as GRPO samples
    (temperature 1, 8 per prompt) and greedy."""
    import torch
    from transformers import set_seed

    set_seed(seed)
    tokenizer = embedded.build_tokenizer()
    model = embedded.build_model(tokenizer)
    embedded.warm_up(model, tokenizer, grpo.GRPOScriptArguments.sft_warmup_steps)
    model.eval()
    data = embedded.build_dataset()
    answers = data["answer"][:prompts]
    batch = tokenizer(data["prompt"][:prompts], return_tensors="pt", padding=True)
    accuracy = []
    for options in (dict(do_sample=True, temperature=1.0, num_return_sequences=8), dict(do_sample=False)):
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=grpo.RECIPE_DEFAULTS["max_completion_length"],
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **options,
            )
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        per_prompt = len(completions) // prompts
        rewards = embedded.accuracy_reward(completions, [a for a in answers for _ in range(per_prompt)])
        accuracy.append(sum(rewards) / len(rewards))
    return accuracy[0], accuracy[1]


def test_the_default_warm_up_leaves_grpo_something_to_learn():
    """The old defaults (200 warm-up steps on sums up to 20) left greedy decoding right 30% of the
    time: the model knew little more than it sampled, and 500 GRPO steps moved the reward from
    0.565 to 0.614. Too long a warm-up would solve the task before GRPO starts."""
    sampled, greedy = sampled_and_greedy_accuracy(seed=42)  # GRPOConfig's default seed
    assert 0.15 < sampled < 0.45, sampled  # GRPO starts well below one right answer in two...
    assert greedy > sampled + 0.15, (greedy, sampled)  # ...with room the model already knows
