"""The GRPO benchmark: TRL's real `GRPOTrainer` on a communication-bound random-weight Qwen2, stock
and with each sync mode of the plugin, full fine-tuning and LoRA, against DDP, the data-parallel
floor (`python -m benchmarks.run --grpo [--beta 0.04]`). This module holds the shapes,
configurations, the saved model, the plan of launches and the merge of their ranks' records;
`grpo_worker.py` measures, `grpo_report.py` reports. Every configuration trains the same saved model
on the same prompts with the same seed, so completions, rewards and losses must agree exactly.
DDP's configurations run in launches of their own (accelerate's state is one per process: FSDP or
not), alternating with FSDP2's round by round, so both see the machine's load alike.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.records import GrpoLaunch, GrpoRankResult, GrpoRankRun, GrpoRow, GrpoRun, launch_fields, memory_max

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("grpo_worker.py")
LORA_TARGETS = ("q_proj", "v_proj")  # what `--lora_target_modules q_proj v_proj` gives TRL's get_peft_config
LAYER_CLASS = "Qwen2DecoderLayer"

# Model and GRPO shapes. `full`: little compute per parameter (short prompts, a 4k vocabulary on
# a 384-wide model), so FSDP's collectives dominate a step, the case a sync mode is for. Every
# micro-batch and every decode step of stock FSDP2 all-gathers every unit, so the completion
# length sets how much of a step generation is. Rounds of 2 steps (1 timed, after step 1's lazy
# init): 3 rounds give the floor target a median and a spread of 3 paired ratios in 6 optimizer
# steps per configuration (stock's, the slowest, set the run's time). `quick`: the smallest shapes
# that still run every phase, for the smoke test.
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512,
              "batch": 2, "M": 2, "generations": 4, "completion": 8, "steps": 2, "rounds": 1},
    "full": {"hidden": 384, "intermediate": 1536, "layers": 4, "heads": 6, "kv_heads": 2, "vocab": 4096,
             "batch": 1, "M": 4, "generations": 4, "completion": 32, "steps": 2, "rounds": 3},
}  # fmt: skip

# A fixed capacity for `auto`, so its plan does not depend on the machine's free RAM at the time:
# far above what any step here holds, so auto windows every unit from step 2 on.
AUTO_FREE_MEMORY = "8GiB"

# Sync modes: (the GradSyncConfig arguments, None: no plugin, stock TRL + accelerate; the label).
MODES: dict[str, tuple[dict[str, Any] | None, str]] = {
    "ddp": (
        None,
        "DDP, no plugin: the same model and GRPO settings, parameters replicated, accelerate's no_sync "
        "over the accumulation (the data-parallel floor: one gradient all-reduce per step)",
    ),
    "stock": (None, "stock TRL + accelerate (no plugin; accelerate's no_sync defers on FSDP2)"),
    "per_micro_batch": ({"defer": False}, "plugin, per-micro-batch sync"),
    "deferred": ({"defer": True}, "plugin, deferred sync"),
    "windowed": (
        {"defer": True, "keep_params_unsharded": True, "keep_reference_unsharded": True, "keep_frozen_unsharded": True},
        "plugin, deferred + keep_params_unsharded (every unit windowed) + keep_reference_unsharded (full fine-tuning: "
        "the reference model gathered once, at its first forward, and kept) + keep_frozen_unsharded (LoRA: the "
        "frozen base gathered once, at its first forward, and kept; only the adapters each step)",
    ),
    "auto": (
        {"sync_mode": "auto", "free_memory": AUTO_FREE_MEMORY},
        f"plugin, auto with --grad-sync-free-memory {AUTO_FREE_MEMORY}",
    ),
    "deferred_gen_resident": (
        {"defer": True, "gather_for_generation": True},
        "plugin, deferred + gather_for_generation (params gathered once per generation)",
    ),
}
# Modes that sum a step's gradients in another floating-point order than stock (accelerate's no_sync
# defers on FSDP2: each rank adds its micro-batches, then one reduce-scatter): per-micro-batch sync
# adds each micro-batch's reduced shard, auto's measured step 1 syncs per micro-batch, DDP divides
# before its all-reduce. Their logged values match stock's within LOG_RTOL, not bit for bit: the
# rounding reaches ~1e-5 relative on KL (~1e-4 itself after two steps at lr 1e-5), while a lost or
# doubled micro-batch changes an update by 1/M, orders of magnitude more.
REORDERED = ("ddp", "per_micro_batch", "auto")
LOG_RTOL = 1e-4
TUNINGS = ("full", "lora")
# Under LoRA, TRL's reference is the policy with its adapter off, no model of its own: nothing for
# keep_reference_unsharded to keep (windowing already keeps the policy). Full fine-tuning has no
# frozen base for keep_frozen_unsharded.
FULL_ONLY = ("keep_reference_unsharded",)
LORA_ONLY = ("keep_frozen_unsharded",)
# Whose generation draws random numbers: TRL generates in train mode, where PEFT's lora_dropout
# (ModelConfig's default, 0.05) is active; Qwen2's attention dropout is 0. There the plugin ends
# each generation with one all-reduce, and the rank done first replays the forwards it runs on
# under transformers' sync, so each rank's random state stays stock's (token_sync.py).
GENERATION_DRAWS = {"full": False, "lora": True}


def gradsync_kwargs(kwargs: dict[str, Any] | None, lora: bool) -> dict[str, Any] | None:
    skip = FULL_ONLY if lora else LORA_ONLY
    return None if kwargs is None else {k: v for k, v in kwargs.items() if k not in skip}


CONFIGS: dict[str, dict[str, Any]] = {
    f"{tuning}/{mode}": {"mode": mode, "lora": tuning == "lora", "gradsync": gradsync_kwargs(kwargs, tuning == "lora")}
    for tuning in TUNINGS
    for mode, (kwargs, _) in MODES.items()
}
DDP = "ddp"


def is_ddp(config: str) -> bool:
    """The configuration runs under DDP (its own launch), not FSDP2."""
    return CONFIGS[config]["mode"] == DDP


def keeps_reference(config: str) -> bool:
    """The configuration asks the plugin to keep a reference model of its own unsharded."""
    return bool((CONFIGS[config]["gradsync"] or {}).get("keep_reference_unsharded"))


def grpo_settings(size: dict, beta: float = 0.0) -> dict:
    """The GRPOConfig fields every configuration shares (the worker adds output_dir, steps, seed).
    beta = 0, TRL's default: no KL term, no reference model, and with one iteration per generation
    no separate no-grad log-prob pass either (the column shows 0). beta > 0 (`--beta`): TRL's
    reference model runs a log-prob pass each step (under LoRA: the policy with its adapter off)."""
    shapes = {
        "per_device_train_batch_size": size["batch"],
        "gradient_accumulation_steps": size["M"],
        "num_generations": size["generations"],
        "max_completion_length": size["completion"],
    }
    # use_configured_state: GRPOConfig would otherwise discard the FSDP state enable_cpu_fsdp() built.
    return dict(
        **shapes,
        beta=beta,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        accelerator_config={"use_configured_state": True},
    )


def embedded():
    """The recipe's built-in `a+b=` task (recipes/embedded.py): its prompts and characters."""
    sys.path.insert(0, str(REPO / "recipes"))
    import embedded

    return embedded


def build_model_dir(path: Path, size_name: str) -> dict:
    """Save the random-weight Qwen2 and its tokenizer to `path`; return its facts. The tokenizer is the
    recipe's characters plus fillers up to the vocabulary, so the head has a language model's share."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    embedded_ = embedded()
    size = SIZES[size_name]
    base = [embedded_.PAD, embedded_.EOS, embedded_.UNK, *embedded_.CHARS]
    vocab = {tok: i for i, tok in enumerate(base + [f"<w{i}>" for i in range(size["vocab"] - len(base))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=embedded_.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=embedded_.PAD, eos_token=embedded_.EOS, unk_token=embedded_.UNK
    )
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    names = {"vocab_size": "vocab", "hidden_size": "hidden", "intermediate_size": "intermediate"}
    names.update(num_hidden_layers="layers", num_attention_heads="heads", num_key_value_heads="kv_heads")
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    shape = {k: size[v] for k, v in names.items()}
    model = Qwen2ForCausalLM(Qwen2Config(**shape, **ids, max_position_embeddings=128, tie_word_embeddings=False))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    facts = {"size": size_name, "params": params, "layer_params": per_layer, **size}
    (Path(path) / "bench_facts.json").write_text(json.dumps(facts))
    return facts


def worker_args(p: dict, model_dir: Path, pin: bool, configs: list[str], round_index: int) -> list[str]:
    """One launch's worker arguments: one round of `configs`; FSDP2's launches also time the backend's
    collectives (windowed's pair against DDP's all-reduce), DDP's do not need to."""
    args = ["--model-dir", str(model_dir), "--size", p["size"], "--configs", ",".join(configs)]
    args += ["--round", str(round_index), "--steps", str(p["steps"]), "--beta", str(p.get("beta", 0.0))]
    return args + (["--pin-cores"] if pin else []) + ([] if is_ddp(configs[0]) else ["--time-collectives"])


def launches(p: dict) -> list[tuple[int, list[str]]]:
    """(round, configurations) of each launch on a network, in order: round by round, FSDP2's
    (accelerate launch), then DDP's (torchrun, its own accelerate state), so that each round's
    FSDP2 and DDP steps run close together, under the same load, and no launch runs them all."""
    fsdp = [c for c in p["configs"] if not is_ddp(c)]
    ddp = [c for c in p["configs"] if is_ddp(c)]
    return [(r, names) for r in range(p["rounds"]) for names in (fsdp, ddp) if names]


def plan_of(args) -> dict:
    size = "quick" if args.quick else "full"
    rounds, steps = args.reps or SIZES[size]["rounds"], args.steps or SIZES[size]["steps"]
    p = {
        "size": size,
        "configs": args.configs.split(",") if args.configs else list(CONFIGS),
        "rounds": rounds,
        "steps": steps,
        "quick": bool(args.quick),
        "beta": args.beta,
    }
    if unknown := [c for c in p["configs"] if c not in CONFIGS]:
        raise SystemExit(f"--configs: unknown GRPO configuration(s) {', '.join(unknown)}; valid: {', '.join(CONFIGS)}")
    if p["steps"] < 2:
        raise SystemExit(f"--steps {p['steps']}: the GRPO benchmark needs at least 2 (step 1 is untimed warm-up)")
    return p


# -- the ranks' records, merged: a step lasts as long as its slowest rank; counts are rank 0's (every
# rank issues the same); memory is the max over ranks and steps.
KINDS = ("all_gathers", "reduce_scatters", "all_reduces")


def launch_of(ranks_json: list[dict]) -> GrpoLaunch:
    """One launch's ranks as written; `combine` merges them with the network's other launches."""
    ranks = [GrpoRankResult.from_dict(r) for r in ranks_json]
    return GrpoLaunch(size=ranks[0].size, facts=ranks[0].facts, ranks=ranks)


def combine(launches: list[GrpoLaunch]) -> GrpoRun:
    """The launches of one network (FSDP2's and DDP's, round by round) as one run: each rank's runs
    over every launch, one row per configuration in configuration order, each from its runs of every
    round; the backend's collectives, the median over the launches that timed them (FSDP2's)."""
    first = launches[0]
    per_rank = [[run for launch in launches for run in launch.ranks[i].runs] for i in range(len(first.ranks))]
    rows = [
        row_of(name, list(zip(*([r for r in runs if r.config == name] for runs in per_rank), strict=True)))
        for name in sorted({r.config for r in per_rank[0]}, key=list(CONFIGS).index)
    ]
    timed = [launch.ranks[0].backend_ms for launch in launches if launch.ranks[0].backend_ms]
    return GrpoRun(
        **launch_fields(first.ranks),
        rows=rows,
        wall_s=round(sum(launch.wall_s or 0 for launch in launches), 1),
        link=first.link,
        hosts=first.hosts,
        ranks_per_host=first.ranks_per_host,
        link_bytes=sum(launch.link_bytes or 0 for launch in launches) if first.link else first.link_bytes,
        backend_ms={op: median(t[op] for t in timed) for op in timed[0]} if timed else {},
    )


def row_of(name: str, rounds: list[tuple[GrpoRankRun, ...]]) -> GrpoRow:
    """A configuration's row from its runs: per round, one run on every rank (rank 0's first). Each
    step's time and phase split are its slowest rank's, the row has the medians over the timed steps
    of every round."""
    steps = [
        (runs[0].round, max(same, key=lambda s: s.time_s))
        for runs in rounds
        for same in zip(*(run.steps for run in runs), strict=True)
    ]
    rank0_runs = [runs[0] for runs in rounds]
    rank0 = [s for run in rank0_runs for s in run.steps]
    every = [s for runs in rounds for run in runs for s in run.steps]
    phases = list(rank0[0].phases) if rank0 else []
    return GrpoRow(
        config=name,
        units=rank0_runs[0].units,
        ref_units=rank0_runs[0].ref_units,
        step_time_s=median(s.time_s for _, s in steps),
        step_times_s=[s.time_s for _, s in steps],
        step_rounds=[r for r, _ in steps],
        phase_time_s={p: median(s.phases[p].time_s for _, s in steps) for p in phases},
        counts_seen={p: {k: sorted({getattr(s.phases[p], k) for s in rank0}) for k in KINDS} for p in phases},
        counts_per_step={
            p: {k: median(getattr(s.phases[p], k) for s in rank0) for k in (*KINDS, "bytes_sent")} for p in phases
        },
        **memory_max(every, [run.handle_held_grad_bytes for runs in rounds for run in runs]),
        state_bytes=max((s.state_bytes for s in every), default=0),
        ref_unsharded_bytes=max((s.ref_unsharded_bytes for s in every), default=0),
        resident_units=int(rank0_runs[0].stats.get("units_resident", 0)),
        resident_bytes=int(rank0_runs[0].stats.get("resident_param_bytes", 0)),
        logprob_gathers=[
            [s.phases["logprob"].all_gathers for s in ([run.first_step] if run.first_step else []) + run.steps]
            for run in rank0_runs
        ],
        logs=[run.logs for run in rank0_runs],
        rewards=[run.rewards for run in rank0_runs],
        completions=[[run.completions for run in runs] for runs in rounds],
        stats=rank0_runs[-1].stats,
    )
