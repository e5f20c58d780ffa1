"""The GRPO benchmark's worker: one launched process group (2 ranks) runs TRL's real
`GRPOTrainer` on the model `grpo.py` saved, once per configuration and round, each run a short
`train()` from the same weights, prompts and seed; rounds rotate the configurations' order.

Each optimizer step is timed from `on_step_begin` to `on_step_end` and split into phases by
wrapping bound methods of the trainer *instance* (never TRL's class): `_generate` (generation),
`_get_per_token_logps_and_entropies` without gradients (log-prob passes), the rest of
`_generate_and_score_completions` ("scoring") and what remains ("training"). Collectives are
counted per phase (`collectives.py`). Completions, rewards and the Trainer's logs are recorded so
the report can compare every configuration with stock exactly. Each rank writes `rank<R>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launched as a script

import psutil  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

import accel_gradsync  # noqa: E402
from benchmarks import grpo  # noqa: E402
from benchmarks.collectives import CollectiveCounter  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    held_grad_bytes,
    held_param_bytes,
    peak_rss_bytes,
    pin_to_core,
    reset_peak_rss,
    versions,
)
from benchmarks.records import GrpoRankResult, GrpoRankRun, GrpoStep, PhaseTotals  # noqa: E402

PHASES = ("generation", "logprob", "scoring", "training")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", required=True, help="model and tokenizer saved by grpo.py")
    p.add_argument("--size", required=True, choices=list(grpo.SIZES))
    p.add_argument("--configs", required=True, help="comma-separated names from grpo.CONFIGS")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is untimed")
    p.add_argument("--pin-cores", action="store_true")
    return p.parse_args()


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Share of even token ids in a completion: a reward a random-weight model's samples spread
    over, so every group has advantages to train on, and a pure function of the completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class Phases:
    """Time and collectives per phase of the step in progress. `enter(phase)` charges what ran
    so far (time, counted collectives) to the phase that was running and switches; on exit it
    switches back, so generation and the log-prob passes nest inside scoring and each moment of
    the step is charged to exactly one phase."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.current = "training"
        self.reset()

    def reset(self) -> None:
        self.counter.take()
        self.totals = {p: PhaseTotals() for p in PHASES}
        self._since = time.perf_counter()

    def _flush(self) -> None:
        now, traffic = time.perf_counter(), self.counter.take_traffic()
        slot = self.totals[self.current]
        slot.time_s += now - self._since
        for kind, value in vars(traffic).items():
            setattr(slot, kind, getattr(slot, kind) + value)
        self._since = now

    @contextlib.contextmanager
    def enter(self, phase: str):
        outer = self.current
        self._flush()
        self.current = phase
        try:
            yield
        finally:
            self._flush()
            self.current = outer

    def take(self) -> dict[str, PhaseTotals]:
        self._flush()
        return self.totals


def wrap_phase(trainer: Any, name: str, phase: str, phases: Phases, when: Callable[[], bool] = lambda: True) -> None:
    """Time the trainer instance's bound method `name` as `phase` (TRL's class stays untouched)."""
    bound = getattr(trainer, name)

    def timed(*args: Any, **kwargs: Any):
        if not when():
            return bound(*args, **kwargs)
        with phases.enter(phase):
            return bound(*args, **kwargs)

    setattr(trainer, name, timed)


def record_outputs(trainer: Any, sink: dict) -> None:
    """Keep every generation's completion ids (a digest per rank) and the rewards, as computed."""
    generate, rewards = trainer._generate, trainer._calculate_rewards

    def generate_recorded(*args: Any, **kwargs: Any):
        out = generate(*args, **kwargs)
        completion_ids = out[1]
        sink["completions"].append(hashlib.sha256(json.dumps(completion_ids).encode()).hexdigest())
        sink["completion_tokens"].append(sum(len(c) for c in completion_ids))
        return out

    def rewards_recorded(*args: Any, **kwargs: Any):
        out = rewards(*args, **kwargs)
        sink["rewards"].append(out.detach().cpu().double().flatten().tolist())
        return out

    trainer._generate, trainer._calculate_rewards = generate_recorded, rewards_recorded


class StepTimer(TrainerCallback):
    """One record per optimizer step: wall time, phases, held bytes after each micro-batch, and
    the step's peak RSS growth."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases
        self.trainer: Any = None
        self.steps: list[GrpoStep] = []
        self.probes: list[tuple[int, int]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        reset_peak_rss()
        self.rss_before = psutil.Process().memory_info().rss
        self.probes = []
        self.phases.reset()
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def probe(self) -> None:
        model = self.trainer.model_wrapped
        self.probes.append((held_grad_bytes(model), held_param_bytes(model)))

    def on_substep_end(self, args, state, control, **kwargs):
        self.probe()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.probe()

    def on_step_end(self, args, state, control, **kwargs):
        elapsed, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        step = GrpoStep(
            step=state.global_step,
            time_s=elapsed,
            cpu_s=cpu,
            phases=self.phases.take(),
            held_grad_bytes=max((g for g, _ in self.probes), default=0),
            held_param_bytes=max((p for _, p in self.probes), default=0),
            rss_growth_bytes=max(peak_rss_bytes() - self.rss_before, 0),
        )
        self.steps.append(step)


def count_units(model: torch.nn.Module) -> int:
    """FSDP2 units of the prepared model: the decoder layers, and what accelerate's wrap policy
    gives the rest (the input embedding is a unit of its own, the root holds the norm and head)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {
        id(g) for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups
    }
    return len(groups)


def run_one(
    name: str, round_index: int, args: argparse.Namespace, counter: CollectiveCounter, dataset, tokenizer
) -> GrpoRankRun:
    """One `GRPOTrainer.train()` of `args.steps` steps for configuration `name`."""
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, get_peft_config

    spec, size = grpo.CONFIGS[name], grpo.SIZES[args.size]
    lora = ModelConfig(use_peft=True, lora_target_modules=list(grpo.LORA_TARGETS))
    peft = get_peft_config(lora) if spec["lora"] else None
    phases = Phases(counter)
    timer = StepTimer(phases)
    outputs: dict[str, list] = {"completions": [], "completion_tokens": [], "rewards": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=args.steps, seed=0, **grpo.grpo_settings(size))
        trainer = GRPOTrainer(
            model=args.model_dir,
            reward_funcs=[parity_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft,
            callbacks=[timer],
        )
        timer.trainer = trainer
        handle = None
        if spec["gradsync"] is not None:
            with contextlib.redirect_stdout(open(os.devnull, "w")):  # the one-line decision
                handle = accel_gradsync.attach(trainer, accel_gradsync.GradSyncConfig(**spec["gradsync"]))
        record_outputs(trainer, outputs)
        wrap_phase(trainer, "_generate", "generation", phases)
        wrap_phase(
            trainer, "_get_per_token_logps_and_entropies", "logprob", phases, lambda: not torch.is_grad_enabled()
        )
        wrap_phase(trainer, "_generate_and_score_completions", "scoring", phases)
        trainer.train()
        logs = [
            {k: e[k] for k in ("step", "loss", "reward", "reward_std", "kl") if k in e}
            for e in trainer.state.log_history
            if "loss" in e
        ]
        units = count_units(trainer.model_wrapped)
        stats = handle.stats() if handle is not None else {}
        if handle is not None:
            handle.detach()
    del trainer
    gc.collect()
    return GrpoRankRun(
        config=name,
        round=round_index,
        steps=[s for s in timer.steps if s.step > 1],  # step 1: FSDP's lazy init, first allocations
        units=units,
        logs=logs,
        completions=outputs["completions"],
        completion_tokens=outputs["completion_tokens"],
        rewards=outputs["rewards"],
        handle_held_grad_bytes=stats.get("last_step/held_grad_bytes"),
        stats={k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    )


def main() -> None:
    args = parse_args()
    core = pin_to_core() if args.pin_cores else None
    accel_gradsync.enable_cpu_fsdp()
    from accelerate import PartialState

    state = PartialState()
    counter = CollectiveCounter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = grpo.build_prompts()
    names = args.configs.split(",")
    runs: list[GrpoRankRun] = []
    for r in range(args.rounds):
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            t0 = time.time()
            rec = run_one(name, r, args, counter, dataset, tokenizer)
            runs.append(rec)
            if state.is_main_process:
                ms = ", ".join(f"{s.time_s * 1e3:.0f}" for s in rec.steps)
                print(f"[bench] grpo {args.size} round {r} {name}: steps {ms} ms ({time.time() - t0:.1f}s)", flush=True)
    facts = grpo.model_facts(args.model_dir)
    result = GrpoRankResult(size=args.size, facts=facts, pinned_core=core, runs=runs, versions=versions("trl", "peft"))
    Path(args.out, f"rank{state.process_index}.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))


if __name__ == "__main__":
    main()
