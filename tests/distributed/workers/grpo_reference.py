"""TRL's real GRPOTrainer with a KL term (beta > 0: a reference model TRL shards itself with FSDP2)
on 2 ranks, stock and with the plugin in each `--modes` in turn (one launch), and the all-gathers
counted from outside the plugin.

Every all-gather FSDP2 issues is wrapped here (torch.distributed, looked up at call time) and
charged to the optimizer step in progress (a global optimizer post-hook) and to the reference
model when the FSDP param group issuing it (found on the call stack) is one of `ref_model`'s, else
to the policy's phase: `_generate` (generation), `_get_per_token_logps_and_entropies` without
gradients (logprob), the rest (training). TRL's methods are wrapped on the instance only. Writes,
per mode, each step's counts, the logs (loss, reward, KL), a digest of every completion, the
rewards, the plugin's stats() and its decision lines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

import accel_gradsync
from benchmarks import grpo

MODES: dict[str, dict | None] = {
    "stock": None,
    "per_micro_batch": {"defer": False},
    "deferred": {"defer": True},
    "windowed": {"defer": True, "keep_params_unsharded": True},
    "gather_for_generation": {"defer": True, "gather_for_generation": True},
    "windowed_resident": {"defer": True, "keep_params_unsharded": True, "keep_reference_unsharded": True},
}


class Counted:
    """All-gathers by (optimizer step, the reference model's or not, phase), counted from outside
    the plugin."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "training"
        self.reference: set[int] = set()
        """`id` of each FSDP2 param group of the reference model."""
        self.by: Counter[tuple[int, bool, str]] = Counter()
        for name in ("all_gather_into_tensor", "all_gather_single"):
            self._wrap(name, getattr(dist, name))
        register_optimizer_step_post_hook(self._stepped)

    def reset(self) -> None:
        self.step, self.phase, self.reference = 0, "training", set()
        self.by.clear()

    def _stepped(self, *_: Any) -> None:
        self.step += 1

    def _wrap(self, name: str, original: Any) -> None:
        def counted(*args: Any, **kwargs: Any) -> Any:
            reference = id(_issuing_group()) in self.reference
            self.by[(self.step, reference, self.phase)] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    @contextlib.contextmanager
    def entered(self, phase: str):
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    def per_step(self) -> list[dict]:
        steps = sorted({s for s, _, _ in self.by})
        return [
            {
                "reference": sum(n for (s, frozen, _), n in self.by.items() if s == step and frozen),
                **{
                    phase: sum(n for (s, frozen, p), n in self.by.items() if s == step and not frozen and p == phase)
                    for phase in ("generation", "logprob", "training")
                },
            }
            for step in steps
        ]


def _issuing_group() -> Any:
    """The FSDPParamGroup whose `unshard` issues the all-gather in progress (torch 2.13)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "unshard" and type(owner).__name__ == "FSDPParamGroup":
            return owner
        frame = frame.f_back
    return None


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def run(mode: str, args: argparse.Namespace, counted: Counted, model_dir: Path, tokenizer: Any) -> dict:
    """One `train()` of `args.steps` steps in `mode`, from the saved weights, with seed 0."""
    from trl import GRPOConfig, GRPOTrainer

    counted.reset()
    size = {**grpo.SIZES["quick"], "M": args.micro_batches}
    settings = grpo.grpo_settings(size)
    settings.update(beta=args.beta, num_iterations=args.num_iterations)
    if args.steps_per_generation:
        settings["steps_per_generation"] = args.steps_per_generation
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=args.steps, seed=0, **settings)
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[parity_reward],
            args=config,
            train_dataset=grpo.embedded().build_dataset(n=256),
            processing_class=tokenizer,
        )
        gathered_in_training: list[int] = []
        if trainer.ref_model is not None:
            groups = trainer.ref_model._get_fsdp_state()._fsdp_param_groups
            counted.reference = {id(g) for g in groups}

            def training_forward(module: Any, args: Any) -> None:
                # After the plugin's own pre-hooks (prepended at bind): the reference model's
                # params must be sharded again before training's forward.
                if torch.is_grad_enabled():
                    gathered_in_training.append(sum(g.is_unsharded for g in groups))

            trainer.model.register_forward_pre_hook(training_forward)
        completions: list[str] = []
        rewards: list[list[float]] = []
        generate, score, logps = (
            trainer._generate,
            trainer._calculate_rewards,
            trainer._get_per_token_logps_and_entropies,
        )

        def generated(*a: Any, **k: Any) -> Any:
            with counted.entered("generation"):
                out = generate(*a, **k)
            completions.append(hashlib.sha256(json.dumps(out[1]).encode()).hexdigest())
            return out

        def scored(*a: Any, **k: Any) -> Any:
            out = score(*a, **k)
            rewards.append(out.detach().double().flatten().tolist())
            return out

        def logprobs(*a: Any, **k: Any) -> Any:
            with counted.entered("logprob") if not torch.is_grad_enabled() else contextlib.nullcontext():
                return logps(*a, **k)

        # This instance's methods only; TRL's class stays as it is.
        trainer._generate, trainer._calculate_rewards = generated, scored
        trainer._get_per_token_logps_and_entropies = logprobs
        handle, lines = None, io.StringIO()
        with contextlib.redirect_stdout(lines):
            if MODES[mode] is not None:
                handle = accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(**MODES[mode]))
            trainer.train()
        # What the end of training leaves of the reference model gathered (a resident one too).
        gathered_after = sum(g.is_unsharded for g in groups) if trainer.ref_model is not None else 0
        keys = ("step", "loss", "reward", "kl")
        logs = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]
        stats = handle.stats() if handle is not None else {}
        if handle is not None:
            handle.detach()
    return {
        "steps": counted.per_step(),
        "reference_groups": len(counted.reference),
        "reference_gathered_in_training": gathered_in_training,
        "reference_gathered_after_training": gathered_after,
        "logs": logs,
        "completions": completions,
        "rewards": rewards,
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, dict))},
        "decision": [line for line in lines.getvalue().splitlines() if line.startswith("grad sync:")],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--modes", required=True, help=f"comma-separated, run in this order: {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=3)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--num-iterations", type=int, default=1)
    args = p.parse_args()

    counted = Counted()
    accel_gradsync.enable_cpu_fsdp()
    from accelerate import PartialState
    from transformers import AutoTokenizer

    state = PartialState()
    model_dir = Path(args.out, "model")  # --out is every rank's (one machine)
    if state.is_main_process:
        grpo.build_model_dir(model_dir, "quick")
    state.wait_for_everyone()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runs = {mode: run(mode, args, counted, model_dir, tokenizer) for mode in args.modes.split(",")}
    Path(args.out, f"rank{state.process_index}.json").write_text(json.dumps(runs, default=str))


if __name__ == "__main__":
    main()
