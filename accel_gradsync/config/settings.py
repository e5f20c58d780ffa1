"""`GradSyncConfig`: the one place every accel_gradsync default lives.

Every field follows accelerate's plugin convention: an explicit value wins, then the
environment variable `ACCEL_GRADSYNC_<FIELD>` (upper case), then the default in `DEFAULTS`.
Fields therefore default to `None` ("not set"), which is also what `HfArgumentParser` /
`TrlParser` hand over when a flag is absent, so the environment still applies under a
recipe's command line.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.values import BOOLEAN_SPELLINGS, Boolean, MemorySize, parse_bool, parse_bytes

ENV_PREFIX = "ACCEL_GRADSYNC_"


class SyncMode(str, enum.Enum):
    """The sync modes: one policy class each in `accel_gradsync.planning.policies.POLICIES`."""

    PER_MICRO_BATCH = "per_micro_batch"
    DEFERRED = "deferred"
    AUTO = "auto"
    BUDGET = "budget"
    DEFER_ALL_REDUCE = "defer_all_reduce"

    def __str__(self) -> str:  # the name itself in messages, logs and JSON (`enum.StrEnum` from 3.11)
        return self.value


SYNC_MODES = tuple(m.value for m in SyncMode)
SAVE_SIGNALS = ("none", "SIGTERM", "SIGUSR1")
"""What `save_on_signal` takes: the signal a scheduler warns with before it kills (SLURM, Kubernetes:
SIGTERM; `sbatch --signal=USR1@120`: SIGUSR1), or none."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype names settings and tables use, and the torch dtypes they stand for."""
REDUCE_DTYPES = ("auto", "fp32", "bf16")
RESIDENCY = ("auto", "true", "false")
"""What `keep_reference_unsharded` and `keep_frozen_unsharded` resolve to (any boolean spelling gives
true or false)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`fp32`, `bf16` or `fp16` (`DTYPES`' names); torch's own name for any other dtype."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


# The single source of every default. `GradSyncConfig()` with an empty environment, the
# recipe's `--help`, a recipe YAML without the key and the environment all resolve to these.
DEFAULTS: dict[str, Any] = {
    # Per-micro-batch sync is the memory-safe choice: deferral holds the whole unsharded
    # gradient on every rank, which is the OOM users hit when it is on by default.
    "defer": False,
    "sync_mode": SyncMode.PER_MICRO_BATCH.value,
    "memory_budget": "",
    "memory_margin": 0.1,
    "free_memory": "",
    "keep_params_unsharded": False,
    "reduce_dtype": "auto",
    # Memory first: keeping every unit unsharded while generating costs the whole unsharded model
    # (compute dtype) on every rank; off, generation all-gathers every unit for every token.
    "gather_for_generation": False,
    # Where the bytes are planned (budget, auto): a reference model resident when it fits; in the
    # other modes it all-gathers once per step, as before the setting existed.
    "keep_reference_unsharded": "auto",
    # As the reference model's residency: where the bytes are planned (budget, auto), the frozen
    # base of a LoRA model unsharded for the run where it fits; with every unit windowed (deferred with
    # keep_params_unsharded, which holds it through each step anyway) all of it; elsewhere gathered every step.
    "keep_frozen_unsharded": "auto",
    # A Trainer log line carries the few per-step counters; the ~20 others stay in stats().
    "log_all_counters": False,
    # No shape, no forecast: auto measures step 1 per micro-batch, which needs no model config.
    "forecast_micro_batch_size": 0,
    "forecast_seq_len": 0,
    # A Trainer's signals keep their own meaning unless asked: saving on one is opt-in (the recipe
    # asks for SIGTERM itself, recipes/grpo.py).
    "save_on_signal": "none",
}


def _boolean(value: Any, source: str, name: str) -> bool:
    return parse_bool(value, source, name)


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str, str], str]:
    def parse(value: Any, source: str, name: str) -> str:
        if value not in choices:
            raise ValueError(f"{source}={value!r} is not a valid `{name}`; valid choices: {', '.join(choices)}.")
        return value

    return parse


def _residency(value: Any, source: str, name: str) -> str:
    """`keep_reference_unsharded`, `keep_frozen_unsharded`: auto, or a boolean in any spelling a
    source gives (true/false)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "true" if parse_bool(value) else "false"
    except ValueError:
        raise ValueError(
            f"{source}={value!r} is not a valid `{name}`; use auto (budget and auto modes "
            f"decide from the bytes) or a boolean ({BOOLEAN_SPELLINGS})."
        ) from None


def _size(fraction_ok: bool) -> Callable[[Any, str, str], str]:
    """A memory size (`memory_budget` also takes a fraction of free memory; `free_memory` cannot)."""

    def parse(value: Any, source: str, name: str) -> str:
        value = "" if value is None else str(value).strip()
        if value and parse_bytes(value, source, fraction_ok).fraction is not None and not fraction_ok:
            raise ValueError(f"{source}={value!r} must be an absolute size with a unit (B, KiB, MiB, GiB), e.g. 40GiB.")
        return value

    return parse


def _margin(value: Any, source: str, name: str) -> float:
    try:
        margin = float(value)
    except (TypeError, ValueError):
        margin = -1.0
    if not 0 <= margin < 1:
        raise ValueError(f"{source}={value!r} is not a valid `{name}`; use a fraction 0 <= margin < 1.")
    return margin


def _count(value: Any, source: str, name: str) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if count < 0 or isinstance(value, float) and value != count:
        raise ValueError(
            f"{source}={value!r} is not a valid `{name}`; use a whole number of "
            f"{'sequences' if 'batch' in name else 'tokens'} (0: no forecast)."
        )
    return count


# Each field's parser, beside DEFAULTS: the value any source gives (a bool, "on", "12GiB") checked
# and spelled one way, with a message naming the source; `_TYPED` then types the few that
# `ResolvedConfig` holds otherwise than as spelled.
_PARSERS: dict[str, Callable[[Any, str, str], Any]] = {
    "defer": _boolean,
    "sync_mode": _choice(SYNC_MODES),
    "memory_budget": _size(fraction_ok=True),
    "memory_margin": _margin,
    "free_memory": _size(fraction_ok=False),
    "keep_params_unsharded": _boolean,
    "reduce_dtype": _choice(REDUCE_DTYPES),
    "gather_for_generation": _boolean,
    "keep_reference_unsharded": _residency,
    "keep_frozen_unsharded": _residency,
    "log_all_counters": _boolean,
    "forecast_micro_batch_size": _count,
    "forecast_seq_len": _count,
    "save_on_signal": _choice(SAVE_SIGNALS),
}
assert _PARSERS.keys() == DEFAULTS.keys()  # invariant: every setting has one parser


def _same(value: Any) -> Any:
    return value


def _auto_or_bool(value: str) -> bool | None:
    return None if value == "auto" else value == "true"


_TYPED: dict[str, Callable[[Any], Any]] = {
    "memory_budget": lambda text: parse_bytes(text) if text else None,
    "free_memory": lambda text: parse_bytes(text).bytes if text else None,
    "keep_reference_unsharded": _auto_or_bool,
    "keep_frozen_unsharded": _auto_or_bool,
}


def _spell_size(size: MemorySize | int | None) -> str:
    if size is None:
        return ""
    if isinstance(size, int):
        return f"{size}B"
    return f"{size.bytes}B" if size.bytes is not None else repr(size.fraction)


def _spell_residency(value: bool | None) -> str:
    return "auto" if value is None else "true" if value else "false"


_SPELLED: dict[str, Callable[[Any], Any]] = {
    "memory_budget": _spell_size,
    "free_memory": _spell_size,
    "keep_reference_unsharded": _spell_residency,
    "keep_frozen_unsharded": _spell_residency,
}
"""`_TYPED`'s inverse, for `spelled`."""


def spelled(settings: ResolvedConfig) -> dict[str, Any]:
    """`settings` as `GradSyncConfig(**...)` takes them back (a child process's spec: JSON)."""
    return {f.name: _SPELLED.get(f.name, _same)(getattr(settings, f.name)) for f in dataclasses.fields(settings)}


def _help(name: str, text: str) -> str:
    return f"{text} Default: {DEFAULTS[name]!r}. Environment: {ENV_PREFIX}{name.upper()}."


def _flag(name: str, text: str, **argparse_kwargs: Any) -> Any:
    """A field that is unset (None) until explicit value > environment > default resolves it."""
    flag = "grad-sync-" + name.removeprefix("sync_").replace("_", "-")  # sync_mode: --grad-sync-mode
    aliases = [f"--{flag}", f"--{flag.replace('-', '_')}"]
    return field(default=None, metadata={"help": _help(name, text), "aliases": aliases, **argparse_kwargs})


class Source(NamedTuple):
    """Where a setting's value came from: `rank` EXPLICIT or ENVIRONMENT, `name` for messages."""

    rank: int
    name: str


EXPLICIT, ENVIRONMENT = 2, 1
"""An explicit value outranks the environment, which outranks the default (rank 0)."""


@dataclass(frozen=True)
class ResolvedConfig:
    """A `GradSyncConfig` once explicit value > environment > default has been applied, typed:
    sizes in bytes, `auto` as None, so no code below `attach` parses a setting's text again.
    `GradSyncConfig.resolved()` makes it; `attach` and the estimate resolve once and hand only
    this down."""

    sync_mode: str
    memory_budget: MemorySize | None
    """Budget mode's bytes or fraction of free memory; None: no budget."""
    memory_margin: float
    free_memory: int | None
    """Bytes per rank to plan with; None: measured."""
    keep_params_unsharded: bool
    reduce_dtype: str
    gather_for_generation: bool
    keep_reference_unsharded: bool | None
    """True or False as set; None: auto (the planned modes decide from the bytes)."""
    keep_frozen_unsharded: bool | None
    """True or False as set; None: auto."""
    log_all_counters: bool
    forecast_micro_batch_size: int
    forecast_seq_len: int
    save_on_signal: str

    @property
    def forecasts(self) -> bool:
        """Whether `auto` plans step 1 from the whole-step forecast (both shape settings given)."""
        return self.forecast_micro_batch_size > 0


@dataclass
class GradSyncConfig:
    """How gradients are synchronised during gradient accumulation.

    Usable directly (`GradSyncConfig(defer=True)`), from the environment
    (`ACCEL_GRADSYNC_DEFER=1`), and as a dataclass for `transformers.HfArgumentParser` or
    `trl.TrlParser` (`--defer-grad-sync`, or `defer: true` in a recipe YAML).
    """

    defer: Boolean | None = field(
        default=None,
        metadata={
            "help": _help(
                "defer",
                "Defer the gradient reduce-scatter (FSDP) / all-reduce (DDP) of every micro-batch but "
                "the last one of each optimizer step: M times fewer collectives, but every rank holds "
                "the whole unsharded gradient between micro-batches. Off: sync after every micro-batch "
                "(sharded gradients, lowest memory). Shorthand for --grad-sync-mode deferred.",
            ),
            "aliases": ["--defer-grad-sync", "--defer_grad_sync"],
            # A bare `--defer-grad-sync` means True, as for transformers' own bool flags.
            "nargs": "?",
            "const": True,
        },
    )
    sync_mode: str | None = _flag(
        "sync_mode",
        "Sync mode: per_micro_batch (sync every micro-batch), deferred (sync once per optimizer "
        "step), auto (step 1 syncs every micro-batch and measures its peak memory, or with "
        "--grad-sync-forecast-micro-batch-size/--grad-sync-forecast-seq-len runs the plan of the forecast peak "
        "from step 1; then each unit windowed, deferred or per micro-batch as what is left allows, on an HSDP "
        "mesh else defer_all_reduce; falls back when peaks grow), budget (FSDP2: per unit, what fits "
        "--grad-sync-memory-budget; the default when a budget is given), defer_all_reduce (HSDP: "
        "reduce-scatter every micro-batch, all-reduce across replicas once per step).",
        choices=SYNC_MODES,
    )
    memory_budget: str | None = _flag(
        "memory_budget",
        "Budget mode: gradient bytes each rank may hold unsharded, e.g. 12GiB, 512MiB, 1048576B "
        "(units B, KiB, MiB, GiB), or a fraction of free device memory such as 0.25. Given without "
        "--grad-sync-mode or --defer-grad-sync (an explicit budget: without an explicit mode), it selects "
        "budget mode.",
    )
    memory_margin: float | None = _flag(
        "memory_margin",
        "auto mode: fraction of the device's capacity kept back as a safety margin above the "
        "measured peak (0 <= margin < 1).",
        type=float,
    )
    free_memory: str | None = _flag(
        "free_memory",
        "Memory per rank to plan with, e.g. 40GiB: auto's capacity instead of the device's (CUDA/NPU "
        "total memory, on CPU the available RAM), and what a fractional budget is a fraction of "
        "instead of measured free memory. Empty: read it from the device.",
    )
    keep_params_unsharded: Boolean | None = _flag(
        "keep_params_unsharded",
        "With deferral (FSDP2), keep each unit's parameters unsharded for the whole accumulation "
        "window: one all-gather per unit per optimizer step instead of up to 2 per micro-batch, at "
        "the cost of the unsharded parameters (compute dtype) beside the held gradients on every "
        "rank until the window's last backward.",
        nargs="?",
        const=True,
    )
    reduce_dtype: str | None = _flag(
        "reduce_dtype",
        "dtype gradients are reduced in, set on the FSDP mixed-precision policy before the model is "
        "prepared: fp32, bf16, or auto: fp32 in sync modes auto and budget under bf16 mixed "
        "precision, else accelerate's choice (the param dtype). FSDP2 holds deferred gradients in "
        "this dtype, so it is also the dtype micro-batches are summed in: bf16 sums differ from "
        "per-micro-batch sync's fp32 ones (docs/modes.md), fp32 holds 4 bytes/param. bf16 keeps auto "
        "and budget in bf16.",
        choices=REDUCE_DTYPES,
    )
    gather_for_generation: Boolean | None = _flag(
        "gather_for_generation",
        "FSDP2: forwards without gradients (generation, no-grad log-prob passes, evaluation) gather "
        "each unit once and keep it unsharded until training resumes (the next forward with "
        "gradients, an optimizer step, an exception, or the end of a Trainer's evaluation, "
        "prediction or training), instead of all-gathering every unit for every generated token; "
        "transformers' generate then runs without its per-token all-reduce (synced_gpus) unless "
        "the caller passes one, from the second generation on, once the first proved that no "
        "forward issues a collective of its own (tensor parallel, MoE) and that what a forward draws "
        "(LoRA dropout) a rank done first can replay: one all-reduce per generation then. Costs the whole "
        "model's unsharded parameters "
        "(compute dtype) on every rank while generating, as DeepSpeed ZeRO-3's "
        "ds3_gather_for_generation does; budget and auto plan with those bytes. Applies in every "
        "sync mode.",
        nargs="?",
        const=True,
    )
    keep_reference_unsharded: str | None = _flag(
        "keep_reference_unsharded",
        "FSDP2: a model nothing trains (a reference model: TRL's ref_model with beta > 0, or a frozen "
        "model prepared beside the trained one) stays unsharded for the whole run: one all-gather at its "
        "first forward, then none per step (DDP's cost, which replicates it), instead of one per step "
        "(gathered for its log-prob pass, resharded before training). Costs its whole unsharded "
        "parameters (compute dtype) on every rank for the whole run. true/false force it; auto: sync modes "
        "budget and auto keep it where those bytes fit what they plan within (the budget; free memory "
        "less the margin), counted before the trained model's units; the other modes do not. A checkpoint "
        "save or load reshards it (FSDP2's own state-dict hooks; the next forward gathers it again), and "
        "so do detach and the end of a Trainer's training.",
        nargs="?",
        const="true",
    )
    keep_frozen_unsharded: str | None = _flag(
        "keep_frozen_unsharded",
        "FSDP2, a trained model with frozen parameters (LoRA over a frozen base): the trainable "
        "parameters inside each unit the accelerate config wraps (the adapters of a decoder layer) get an "
        "FSDP2 unit of their own at prepare, and the units left with only frozen parameters stay unsharded "
        "for the whole run: one all-gather at their first forward, then none; each step gathers only the "
        "adapters. Costs the kept units' whole unsharded parameters (compute dtype) on every rank for the "
        "whole run. true/false force it; auto: sync modes budget and auto keep each frozen unit, in order, "
        "while its bytes fit what they plan within (after resident reference models), and plan the trained "
        "units within what is left; deferred with keep_params_unsharded (every unit windowed: it holds every "
        "unit through the step anyway) keeps every frozen unit; the other modes keep none. attach() must come before "
        "accelerator.prepare(model) (a Trainer prepares in train()); not with fsdp_cpu_ram_efficient_loading. "
        "A checkpoint save or load reshards the kept units (the next forward gathers them again), and so "
        "do detach and grad_sync.reshard_frozen() (call it before merging the adapter between steps). "
        "true is refused on FSDP1 and under TRL's use_vllm, where auto keeps nothing.",
        nargs="?",
        const="true",
    )
    log_all_counters: Boolean | None = _flag(
        "log_all_counters",
        "Trainer logs (console and report_to): every grad_sync/ counter (totals since attach and the "
        "last step's), instead of the few per-step ones: reduce-scatters (HSDP/DDP: all-reduces) "
        "issued and skipped in the step, held gradient bytes, units at each level (auto: plan "
        "changes, the measured and the forecast peak). stats() always has everything.",
        nargs="?",
        const=True,
    )
    forecast_micro_batch_size: int | None = _flag(
        "forecast_micro_batch_size",
        "auto mode: sequences per micro-batch for the whole-step forecast (with --grad-sync-forecast-seq-len). "
        "Given, auto forecasts the step's peak per rank from the model config at bind (as `accel-gradsync "
        "estimate --micro-batch-size` does) and runs its plan from step 1; 0: step 1 syncs every micro-batch and "
        "measures its peak.",
        type=int,
    )
    forecast_seq_len: int | None = _flag(
        "forecast_seq_len",
        "auto mode: tokens per sequence for the whole-step forecast (the longest a micro-batch holds; GRPO: "
        "prompt plus completion). 0: no forecast.",
        type=int,
    )
    save_on_signal: str | None = _flag(
        "save_on_signal",
        "Trainer (or a loop that asks grad_sync.preempted()): on this signal (SIGTERM, SIGUSR1, or none) every "
        "rank finishes the optimizer step it is in, the ranks agree, a complete checkpoint is saved and the "
        "process exits with code 75 "
        "(accel_gradsync.PREEMPTED_EXIT_CODE), so that --resume_from_checkpoint continues from that step "
        "(docs/recipe.md, Preemption). Costs one small collective per optimizer step. none: the signal "
        "keeps its own meaning.",
        choices=SAVE_SIGNALS,
    )

    def __post_init__(self) -> None:
        given: dict[str, Source] = {}
        for f in dataclasses.fields(self):
            value, env_name = getattr(self, f.name), ENV_PREFIX + f.name.upper()
            if value is not None:
                given[f.name] = Source(EXPLICIT, f"GradSyncConfig.{f.name}")
            elif env_name in os.environ:
                value, given[f.name] = os.environ[env_name], Source(ENVIRONMENT, env_name)
            else:
                value = DEFAULTS[f.name]
            setattr(self, f.name, _coerce(f.name, value, given[f.name].name if f.name in given else "default"))
        self._choose_mode(given)
        self._check_combination(given)

    def _choose_mode(self, given: dict[str, Source]) -> None:
        """`defer` and `sync_mode` each ask for a mode: the one given at the higher rank decides,
        and at one rank defer=True and another sync mode contradict. A memory budget selects
        budget mode where no mode is asked for at its rank or above."""
        rank = {name: given[name].rank if name in given else 0 for name in ("defer", "sync_mode")}
        if self.defer and rank["defer"] == rank["sync_mode"] and self.sync_mode != SyncMode.DEFERRED:
            raise ValueError(
                f"{given['defer'].name}=True and {given['sync_mode'].name}={self.sync_mode!r} contradict: "
                "--defer-grad-sync is shorthand for --grad-sync-mode deferred. Set only one of them."
            )
        if self.defer and rank["defer"] > rank["sync_mode"]:
            self.sync_mode = SyncMode.DEFERRED.value
        elif "defer" in given and rank["defer"] > rank["sync_mode"] and self.sync_mode == SyncMode.DEFERRED:
            # defer=False is the switch's off position: it turns off the deferral a lower rank asks for.
            self.sync_mode, rank["sync_mode"] = DEFAULTS["sync_mode"], 0
        # A budget names what to hold, as --defer-grad-sync does: it asks for budget mode at its own
        # rank, so it outranks a mode from a lower one and gives way (with a warning) at the same.
        asked = max(rank["sync_mode"], rank["defer"] if self.defer else 0)
        if self.memory_budget and given["memory_budget"].rank > asked:
            self.sync_mode = SyncMode.BUDGET.value
        self.defer = self.defer and self.sync_mode == SyncMode.DEFERRED  # False where outranked

    def _check_combination(self, given: dict[str, Source]) -> None:
        if self.sync_mode == SyncMode.BUDGET and not self.memory_budget:
            raise ValueError(
                "GradSyncConfig.sync_mode='budget' needs a memory budget: set --grad-sync-memory-budget "
                "(e.g. 12GiB, 512MiB or a fraction of free memory such as 0.5)."
            )

        # Settings only some modes read: say once that they are ignored, never drop them silently.
        used_by = {
            "memory_budget": (SyncMode.BUDGET,),
            "memory_margin": (SyncMode.AUTO,),
            "free_memory": (SyncMode.AUTO, SyncMode.BUDGET),
            "keep_params_unsharded": (SyncMode.DEFERRED, SyncMode.BUDGET, SyncMode.AUTO),
            "forecast_micro_batch_size": (SyncMode.AUTO,),
            "forecast_seq_len": (SyncMode.AUTO,),
        }
        for name, modes in used_by.items():
            # A value equal to the default changes nothing, so nothing is lost by ignoring it.
            if name in given and getattr(self, name) != DEFAULTS[name] and self.sync_mode not in modes:
                warnings.warn(
                    f"accel_gradsync: {given[name].name}={getattr(self, name)!r} is ignored in sync mode "
                    f"{self.sync_mode!r}; it applies to: {', '.join(modes)}.",
                    GradSyncWarning,
                    stacklevel=4,
                )
        sequences, tokens = int(self.forecast_micro_batch_size or 0), int(self.forecast_seq_len or 0)
        if (sequences > 0) != (tokens > 0):
            set_one, missing = (
                ("forecast_micro_batch_size", "--grad-sync-forecast-seq-len")
                if sequences > 0
                else ("forecast_seq_len", "--grad-sync-forecast-micro-batch-size")
            )
            raise ValueError(
                f"{given[set_one].name}={getattr(self, set_one)!r}: the step forecast needs both the micro-batch "
                f"size and the sequence length; also set {missing} (or neither, to measure step 1)."
            )

    def resolved(self) -> ResolvedConfig:
        """The settings as resolved in `__post_init__`, typed (`_TYPED`): what goes below `attach`."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(ResolvedConfig)}
        assert all(v is not None for v in values.values()), values  # __post_init__ sets every field
        return ResolvedConfig(**{name: _TYPED.get(name, _same)(value) for name, value in values.items()})

    @property
    def free_memory_bytes(self) -> int | None:
        """`free_memory` in bytes, or None when it is to be measured."""
        return self.resolved().free_memory

    @property
    def mode(self) -> str:
        """Name of the sync policy this config selects (see `accel_gradsync.planning.policies.POLICIES`)."""
        return self.resolved().sync_mode


def _coerce(name: str, value: Any, source: str) -> Any:
    """Validate one field, accepting the string spellings a CLI, YAML or environment gives."""
    return _PARSERS[name](value, source, name)
