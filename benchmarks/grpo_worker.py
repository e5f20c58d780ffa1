"""The GRPO benchmark's worker: 2 ranks run TRL's real `GRPOTrainer` on the model `grpo.py` saved, a
short `train()` per configuration from the same weights, prompts and seed, for one round (`--round`:
the harness alternates FSDP2's and DDP's launches round by round; the round rotates the order),
and write `rank<R>.json`. Each step is metered and split into phases by wrapping bound methods of
the trainer *instance* (never TRL's class): `_generate` (generation),
`_get_per_token_logps_and_entropies` without gradients (log-prob passes), the rest of
`_generate_and_score_completions` (scoring), the remainder (training); collectives are counted per
phase, step 1 included (a resident reference model is gathered there), except those of the
accelerator's `gather` (TRL's metrics). Completions, rewards and logs are recorded for the report
to compare with stock, and after each optimizer step what the rank keeps between steps
(`state_bytes`; of it, the reference model's unsharded parameters). Launched with FSDP2's
accelerate config, or for DDP's configurations by torchrun with accelerate on CPU (MULTI_CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import hashlib
import json
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import accel_gradsync
from benchmarks import grpo, measure
from benchmarks.records import GrpoRankResult, GrpoRankRun, GrpoStep, PhaseTotals
from testbed.collectives import CollectiveCounter

PHASES = ("generation", "logprob", "scoring", "training")


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Share of even token ids in a completion: a reward a random-weight model's samples spread
    over, so every group has advantages to train on, and a pure function of the completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class Phases:
    """Time and collectives per phase of the step in progress. `enter(phase)` charges what ran so far
    to the phase that was running and switches; on exit it switches back, so generation and the
    log-prob passes nest inside scoring and each moment of the step is charged to one phase."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter, self.current = counter, "training"
        self.reset()

    def reset(self) -> None:
        self.counter.take()
        self.totals, self.since = {p: PhaseTotals() for p in PHASES}, time.perf_counter()

    def take(self) -> dict[str, PhaseTotals]:
        now, slot = time.perf_counter(), self.totals[self.current]
        slot.time_s += now - self.since
        for kind, value in vars(self.counter.take_traffic()).items():
            setattr(slot, kind, getattr(slot, kind) + value)
        self.since = now
        return self.totals

    @contextlib.contextmanager
    def enter(self, phase: str):
        outer = self.current
        self.take()
        self.current = phase
        try:
            yield
        finally:
            self.take()
            self.current = outer


def wrap(
    instance: Any,
    name: str,
    phase: tuple[Phases, str] | None = None,
    when=lambda: True,
    after=None,
    uncounted: CollectiveCounter | None = None,
) -> None:
    """Wrap the bound method `name` of an instance (the trainer's, its accelerator's: their classes
    stay untouched): its time is charged to `phase` (phases, name) when `when()`, `after(out)` sees
    what it returned, and with `uncounted` the collectives it issues are not counted."""
    bound = getattr(instance, name)

    def wrapped(*args: Any, **kwargs: Any):
        with phase[0].enter(phase[1]) if phase and when() else contextlib.nullcontext():
            with uncounted.paused() if uncounted else contextlib.nullcontext():
                out = bound(*args, **kwargs)
            if after:
                after(out)
        return out

    setattr(instance, name, wrapped)


def state_bytes(trainer: Any) -> tuple[int, int]:
    """What this rank keeps between optimizer steps: the trained and the reference model's
    parameters as stored (FSDP2: the local shard, plus any unsharded storage still allocated;
    DDP: every parameter), their gradients, and the optimizer's state; and of it, the reference
    model's unsharded parameters (read from its FSDP2 tensors: what keeping it resident costs)."""
    ref = getattr(trainer, "ref_model", None)
    models = [m for m in (trainer.model_wrapped, ref) if m is not None]
    # FSDP2 swaps a unit's module parameters for its unsharded ones while unsharded: count its
    # shards from FSDPParam and the unsharded storage once, through held_bytes.
    fsdp_params = {id(fp): fp for m in models for g in measure.fsdp2_groups(m) for fp in g.fsdp_params}.values()
    managed = {id(t) for fp in fsdp_params for t in (fp.sharded_param, getattr(fp, "_unsharded_param", None))}
    total = sum(measure.nbytes(fp.sharded_param) + measure.nbytes(fp.sharded_param.grad) for fp in fsdp_params)
    params = {id(p): p for m in models for p in m.parameters() if id(p) not in managed}
    total += sum(measure.nbytes(p) + measure.nbytes(p.grad) for p in params.values())
    total += sum(measure.held_bytes(m)[1] for m in models)  # FSDP2 params left unsharded
    for state in trainer.optimizer.state.values():
        total += sum(measure.nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total, measure.held_bytes(ref)[1] if ref is not None else 0


def run_one(name: str, round_index: int, args: argparse.Namespace, phases: Phases, dataset, tokenizer) -> GrpoRankRun:
    """One `GRPOTrainer.train()` of `args.steps` steps for configuration `name`."""
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, get_peft_config

    spec, size = grpo.CONFIGS[name], grpo.SIZES[args.size]
    lora = ModelConfig(use_peft=True, lora_target_modules=list(grpo.LORA_TARGETS))
    steps: list[GrpoStep] = []
    completions: list[str] = []
    rewards: list[list[float]] = []

    # --profile: rank 0's timed steps (after step 1, FSDP's lazy init), from the end of step 1 on.
    profiler = cProfile.Profile() if args.profile and torch.distributed.get_rank() == 0 else None

    def done(state, measured: dict) -> None:
        held, ref_held = state_bytes(callback.trainer)
        step = GrpoStep(step=state.global_step, phases=phases.take(), state_bytes=held, **measured)
        steps.append(dataclasses.replace(step, ref_unsharded_bytes=ref_held))
        if profiler is not None and state.global_step == 1:
            profiler.enable()

    def digest(out) -> None:  # each generation's completion ids, as a digest per rank
        completions.append(hashlib.sha256(json.dumps(out[1]).encode()).hexdigest())

    callback = measure.step_callback(measure.StepMeter(), phases.reset, done)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, max_steps=args.steps, seed=0, **grpo.grpo_settings(size, args.beta))
        peft = get_peft_config(lora) if spec["lora"] else None
        trainer = GRPOTrainer(
            model=args.model_dir,
            reward_funcs=[parity_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft,
            callbacks=[callback],
        )
        callback.trainer, handle = trainer, measure.attach(trainer, spec["gradsync"])
        wrap(trainer, "_generate", (phases, "generation"), after=digest)
        wrap(
            trainer,
            "_calculate_rewards",
            after=lambda out: rewards.append(out.detach().cpu().double().flatten().tolist()),
        )
        wrap(trainer, "_get_per_token_logps_and_entropies", (phases, "logprob"), lambda: not torch.is_grad_enabled())
        wrap(trainer, "_generate_and_score_completions", (phases, "scoring"))
        # TRL gathers its metrics with accelerator.gather, on gloo a list-form all_gather per metric:
        # not the models' collectives, which are what the counts are for.
        wrap(trainer.accelerator, "gather", uncounted=phases.counter)
        trainer.train()
        if profiler is not None:
            profiler.disable()
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(Path(args.profile, f"{name.replace('/', '_')}_r{round_index}.prof"))
        keys = ("step", "loss", "reward", "reward_std", "kl")
        logs = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]
        units, stats = len(measure.fsdp2_groups(trainer.model_wrapped)), measure.scalar_stats(handle)
        ref_units = len(measure.fsdp2_groups(trainer.ref_model)) if trainer.ref_model is not None else 0
        if handle is not None:
            handle.detach()
    del trainer
    gc.collect()
    return GrpoRankRun(
        config=name,
        round=round_index,
        steps=[s for s in steps if s.step > 1],  # 1: FSDP's lazy init
        units=units,
        first_step=next((s for s in steps if s.step == 1), None),
        ref_units=ref_units,
        logs=logs,
        completions=completions,
        rewards=rewards,
        handle_held_grad_bytes=stats.get("last_step/held_grad_bytes"),
        stats=stats,
    )


def time_collectives(numel: int, reps: int = 3) -> dict[str, float]:
    """Median ms of one all-gather and one reduce-scatter of `numel` fp32 elements (what windowed
    moves for the whole model, each once per step) and of one all-reduce of them (DDP's gradient
    sync, the same bytes by the ring formula), on this launch's process group: what the backend
    itself charges for each, apart from FSDP2, TRL and the plugin."""
    world = dist.get_world_size()
    full = torch.ones(numel - numel % world)
    shard = torch.ones(full.numel() // world)
    ops = {
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_reduce": lambda: dist.all_reduce(full),
    }
    out = {}
    for name, op in ops.items():
        op()  # warm-up: the backend's buffers for this size
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        out[name] = median(times) * 1e3
    return out


def main() -> None:
    args = measure.worker_args(
        model_dir="", size="", configs="", round=0, steps=3, beta=0.0, profile=None, time_collectives=False
    )
    core = measure.pin_to_core() if args.pin_cores else None
    fsdp = accel_gradsync.enable_cpu_fsdp()
    from accelerate import PartialState

    # DDP's launch (torchrun, no accelerate config): accelerate's MULTI_CPU state, as
    # Accelerator(cpu=True) builds it, for the GRPOConfig to use.
    state = PartialState() if fsdp or torch.cuda.is_available() else PartialState(cpu=True)
    phases = Phases(CollectiveCounter())
    tokenizer, dataset = AutoTokenizer.from_pretrained(args.model_dir), grpo.embedded().build_dataset(n=512)
    names, runs, r = args.configs.split(","), [], args.round
    k = r % max(len(names), 1)
    for name in names[k:] + names[:k]:
        t0 = time.time()
        runs.append(rec := run_one(name, r, args, phases, dataset, tokenizer))
        if state.is_main_process:
            ms = ", ".join(f"{s.time_s * 1e3:.0f}" for s in rec.steps)
            print(f"[bench] grpo {args.size} round {r} {name}: steps {ms} ms ({time.time() - t0:.1f}s)", flush=True)
    facts = json.loads(Path(args.model_dir, "bench_facts.json").read_text())
    backend = time_collectives(facts["params"]) if args.time_collectives else {}
    launch = {"size": args.size, "facts": facts, "pinned_core": core, "versions": measure.versions("trl", "peft")}
    measure.write_rank(args.out, state.process_index, GrpoRankResult(**launch, runs=runs, backend_ms=backend))


if __name__ == "__main__":
    main()
