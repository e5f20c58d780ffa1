"""The estimate's inputs: the launch (an accelerate config file, or the `DistributedConfig` keys of a
model transformers shards at load time) read into an `FSDPSetup`, and the model's transformers config.

`accelerate launch` reads the same file through environment variables; `FSDPSetup` keeps only the
keys that decide units, dtypes and mesh. Every bad input is a one-line `ValueError` naming the file
or flag, the value and what to set: the CLI prints it as its error line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

RECIPE_DEFAULT = "recipe-default"
RECIPE_DEFAULT_MODEL: dict[str, Any] = {
    "model_type": "qwen2",
    # The recipe's character tokenizer: <pad>, <eos>, <unk> and "0123456789+-= ".
    "vocab_size": 17,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
    # Small enough that a GRPO step (generation + M micro-batches) takes about a second on 2 CPU cores.
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,  # FSDP units: one per Qwen2DecoderLayer plus the root (embeddings, norm, head)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
"""The config of the GRPO recipe's built-in tiny Qwen2 (`recipes/embedded.py` builds its model
from it), which `--model recipe-default` estimates without anything outside the package."""

OPTIMIZERS = ("adamw", "sgd")
"""What the step forecast can build: AdamW (two moments in the params' dtype) and plain SGD (no state)."""
_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DISTRIBUTED_KEYS = ("fsdp_size", "dp_replicate_size", "fsdp_mixed_precision", "fsdp_cpu_offload", "fsdp_plan")


@dataclass(frozen=True)
class FSDPSetup:
    """The parts of an accelerate config that decide units, dtypes and mesh."""

    fsdp_version: int = 1
    num_processes: int = 1
    mixed_precision: str = "no"
    auto_wrap_policy: str = "NO_WRAP"
    layer_cls_to_wrap: tuple[str, ...] | None = None
    """None: the model's `_no_split_modules`, as accelerate does."""
    min_num_params: int = 0
    replicate_size: int = 1
    shard_size: int = 1
    reshard_after_forward: bool = True
    """FSDP2 `fsdp_reshard_after_forward`; FSDP1: sharding strategy FULL_SHARD (vs SHARD_GRAD_OP)."""
    use_orig_params: bool = False
    """FSDP1 `fsdp_use_orig_params` (units are the same either way; passed on as a launch would)."""
    distributed_config: tuple[tuple[str, Any], ...] = ()
    """A model transformers shards at load time: its `DistributedConfig` keys (empty: accelerate shards)."""

    @property
    def hsdp(self) -> bool:
        return self.replicate_size > 1


def read_launch_setup(
    accelerate_config: str | os.PathLike | dict | None,
    distributed_config: str | os.PathLike | dict | None,
    num_processes: int | None = None,
    mixed_precision: str | None = None,
) -> FSDPSetup:
    """The `FSDPSetup` of exactly one of `accelerate_config` (accelerate shards the model) and
    `distributed_config` (transformers shards it at load time); the overrides apply to the first."""
    if (accelerate_config is None) == (distributed_config is None):
        raise ValueError(
            "give exactly one of --accelerate-config (accelerate shards the model) and --distributed-config "
            "(transformers shards it at load time: from_pretrained(..., distributed_config=...))."
        )
    if distributed_config is not None:
        return read_distributed_config(distributed_config)
    assert accelerate_config is not None  # one of the two, checked above
    return read_accelerate_config(accelerate_config, num_processes, mixed_precision)


def read_accelerate_config(
    source: str | os.PathLike | dict, num_processes: int | None = None, mixed_precision: str | None = None
) -> FSDPSetup:
    """An `FSDPSetup` from an accelerate config file (YAML/JSON) or the same keys as a dict.
    `num_processes` and `mixed_precision` override the file's, as the same flags of
    `accelerate launch` do."""
    if isinstance(source, dict):
        config, where = source, "the accelerate config"
    else:
        config, where = _read_config_file(Path(source)), str(source)
    if str(config.get("distributed_type", "")).upper() != "FSDP":
        raise ValueError(
            f"{where}: distributed_type={config.get('distributed_type')!r}; the estimate covers FSDP runs, set "
            "distributed_type: FSDP (and an fsdp_config) in the accelerate config."
        )
    fsdp = config.get("fsdp_config") or {}
    version = int(fsdp.get("fsdp_version", 1))
    processes = int(num_processes if num_processes is not None else config.get("num_processes", 1))
    if processes < 1:
        setting = "--num_processes" if num_processes is not None else f"{where}: num_processes"
        raise ValueError(
            f"{setting}={processes} is not a number of processes; give at least 1, as for accelerate launch."
        )
    mixed = str(mixed_precision or config.get("mixed_precision", "no")).lower()
    if mixed not in _MIXED_PRECISION:
        raise ValueError(f"{where}: mixed_precision={mixed!r}; valid choices: {', '.join(_MIXED_PRECISION)}.")
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
    if policy not in _WRAP_POLICIES:
        raise ValueError(f"{where}: fsdp_auto_wrap_policy={policy!r}; valid choices: {', '.join(_WRAP_POLICIES)}.")
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",") if c.strip()]
    parallel = config.get("parallelism_config") or {}
    replicate = int(parallel.get("parallelism_config_dp_replicate_size", 1))
    shard = int(parallel.get("parallelism_config_dp_shard_size", processes // replicate))
    if replicate * shard != processes:
        raise ValueError(
            f"{where}: dp_replicate_size x dp_shard_size = {replicate} x {shard} != num_processes={processes}; "
            "make their product equal the number of processes."
        )
    default = "true" if version == 2 else "FULL_SHARD"
    strategy = str(fsdp.get("fsdp_sharding_strategy", fsdp.get("fsdp_reshard_after_forward", default))).upper()
    if version == 1 and strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD"):
        raise ValueError(
            f"{where}: FSDP1 sharding strategy {strategy} is not covered by the estimate; use FULL_SHARD or "
            "SHARD_GRAD_OP, or FSDP2 with parallelism_config for HSDP."
        )
    return FSDPSetup(
        fsdp_version=version,
        num_processes=processes,
        mixed_precision=mixed,
        auto_wrap_policy=policy,
        layer_cls_to_wrap=tuple(classes) if classes else None,
        min_num_params=int(fsdp.get("fsdp_min_num_params", 0)),
        replicate_size=replicate,
        shard_size=shard,
        reshard_after_forward=strategy in ("TRUE", "FULL_SHARD", "1"),
        use_orig_params=str(fsdp.get("fsdp_use_orig_params", False)).lower() == "true",
    )


def read_distributed_config(source: str | os.PathLike | dict) -> FSDPSetup:
    """An `FSDPSetup` for a model transformers shards at load time, from the keys of its
    `DistributedConfig` (a dict, JSON text, or a JSON/YAML file): FSDP2 over `fsdp_size` ranks,
    HSDP with `dp_replicate_size` > 1. Tensor, pipeline and expert parallelism are refused."""
    keys = dict(source) if isinstance(source, dict) else _parse_distributed_keys(source)
    unknown = sorted(set(keys) - set(_DISTRIBUTED_KEYS))
    if unknown:
        raise ValueError(
            f"--distributed-config: {', '.join(unknown)} not covered by the estimate (it plans FSDP and HSDP, "
            f"not tensor, pipeline or expert parallelism); valid keys: {', '.join(_DISTRIBUTED_KEYS)}."
        )
    replicate, shard = int(keys.get("dp_replicate_size") or 1), int(keys.get("fsdp_size") or 1)
    if replicate < 1 or shard < 1 or replicate * shard < 2:
        raise ValueError(
            f"--distributed-config: fsdp_size={shard} x dp_replicate_size={replicate} does not shard anything; "
            "give sizes >= 1 whose product is the number of processes (at least 2)."
        )
    return FSDPSetup(
        fsdp_version=2,
        num_processes=replicate * shard,
        # DistributedConfig(fsdp_mixed_precision=True): bf16 params, fp32 reduce (transformers' policy).
        mixed_precision="bf16" if keys.get("fsdp_mixed_precision") else "no",
        replicate_size=replicate,
        shard_size=shard,
        distributed_config=tuple(sorted(keys.items())),
    )


@dataclass(frozen=True)
class StepShape:
    """What the step forecast needs beyond the launch: the micro-batch and the training setup."""

    micro_batch_size: int
    seq_len: int
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    max_completion_length: int = 0
    """GRPO: tokens generated per completion, the end of each sequence of `seq_len` (the rest is the
    prompt); 0: no generation phase simulated."""
    num_generations: int = 0
    """GRPO: completions per prompt (checked as TRL checks it against the generation batch); 0: not given."""

    def __post_init__(self) -> None:
        for flag, value in (("--micro-batch-size", self.micro_batch_size), ("--seq-len", self.seq_len)):
            if value < 1:
                raise ValueError(f"{flag}={value}: the forecast needs a positive number of sequences/tokens.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer={self.optimizer!r}: the forecast models {' and '.join(OPTIMIZERS)}.")
        if not 0 <= self.max_completion_length < self.seq_len:
            raise ValueError(
                f"--max-completion-length={self.max_completion_length}: the completion is the end of each sequence "
                f"of --seq-len={self.seq_len} tokens (prompt plus completion); pass a length from 0 to "
                f"{self.seq_len - 1}."
            )
        if self.num_generations < 0:
            raise ValueError(f"--num-generations={self.num_generations}: needs at least 1 completion per prompt.")
        if self.num_generations and not self.max_completion_length:
            raise ValueError(
                f"--num-generations={self.num_generations}: it is read with --max-completion-length (GRPO's "
                "generation); pass that too, or leave --num-generations out."
            )

    def generation_batch(self, micro_batches: int) -> int:
        """Sequences one rank generates at once: TRL generates for `steps_per_generation` micro-batches
        at once, by default the gradient accumulation steps."""
        return self.micro_batch_size * micro_batches


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA fine-tune of the model (PEFT `LoraConfig`): only the adapters train, the base is frozen."""

    r: int
    target_modules: tuple[str, ...] | None = None
    """None: PEFT's default modules for the architecture (q_proj and v_proj for Llama and Qwen2)."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"--lora-r={self.r}: the LoRA rank must be at least 1 (or leave --lora-r out).")


def read_lora(r: int | None, target_modules: str = "") -> LoraSpec | None:
    """The CLI's `--lora-r` / `--lora-target-modules` (comma-separated), or None for full fine-tuning
    (`r` not given; a given rank below 1 is refused)."""
    if r is None:
        if target_modules:
            raise ValueError(f"--lora-target-modules={target_modules!r} is read with --lora-r; pass a rank too.")
        return None
    names = tuple(n.strip() for n in target_modules.split(",") if n.strip())
    return LoraSpec(r, names or None)


def read_step_shape(
    micro_batch_size: int | None,
    seq_len: int | None,
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    max_completion_length: int | None = None,
    num_generations: int | None = None,
) -> StepShape | None:
    """The step forecast's `StepShape` from the CLI's flags, or None when neither
    --micro-batch-size nor --seq-len is given (then the flags that only the forecast reads are refused).
    The two GRPO counts are None when not given; a given one below 1 is refused."""
    for flag, count in (("--max-completion-length", max_completion_length), ("--num-generations", num_generations)):
        if count is not None and count < 1:
            raise ValueError(f"{flag}={count}: needs at least 1 (leave {flag} out for no generation phase).")
    if micro_batch_size is None and seq_len is None:
        if optimizer != "adamw" or gradient_checkpointing or max_completion_length or num_generations:
            flag = (
                "--gradient-checkpointing"
                if gradient_checkpointing
                else f"--max-completion-length {max_completion_length}"
                if max_completion_length
                else f"--num-generations {num_generations}"
                if num_generations
                else f"--optimizer {optimizer}"
            )
            raise ValueError(
                f"{flag} is read only by the step forecast; also pass --micro-batch-size and --seq-len "
                "(e.g. --micro-batch-size 4 --seq-len 512)."
            )
        return None
    if micro_batch_size is None or seq_len is None:
        missing = "--seq-len" if seq_len is None else "--micro-batch-size"
        raise ValueError(
            f"the step forecast needs both --micro-batch-size and --seq-len; also pass {missing} "
            "(e.g. --micro-batch-size 4 --seq-len 512)."
        )
    return StepShape(
        micro_batch_size, seq_len, optimizer, gradient_checkpointing, max_completion_length or 0, num_generations or 0
    )


def load_model_config(spec: str | dict) -> Any:
    """A transformers config from `recipe-default` (the GRPO recipe's embedded tiny Qwen2), a dict
    of config keys with `model_type`, a local directory/config.json, or a hub name (online only)."""
    from transformers import AutoConfig

    if spec == RECIPE_DEFAULT:
        spec = RECIPE_DEFAULT_MODEL
    if isinstance(spec, dict):
        kwargs = dict(spec)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError("a model config dict needs a `model_type` key, e.g. {'model_type': 'qwen2', ...}.")
        return AutoConfig.for_model(model_type, **kwargs)
    if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        # transformers would report a missing `model_type` key, as if there were a config.json.
        raise ValueError(
            f"--model {spec!r}: the directory holds no config.json; pass a directory with a transformers "
            f"config.json, a hub name (needs network access), or {RECIPE_DEFAULT!r}."
        )
    try:
        return AutoConfig.from_pretrained(spec)
    except OSError as err:
        raise ValueError(
            f"--model {spec!r}: no transformers config found ({err}). Pass a local directory holding a "
            f"config.json, a hub name (needs network access), or {RECIPE_DEFAULT!r}."
        ) from None


def _parse_distributed_keys(source: str | os.PathLike) -> dict:
    """`--distributed-config`'s keys from a JSON/YAML file, or from the value itself as JSON."""
    text = Path(source).read_text() if Path(source).is_file() else str(source)
    try:
        keys = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError:
        keys = None
    if not isinstance(keys, dict):
        raise ValueError(
            f"--distributed-config {str(source)!r} is neither a file nor a mapping; give DistributedConfig's "
            'keys, e.g. \'{"fsdp_size": 8, "dp_replicate_size": 2}\'.'
        )
    return keys


def _read_config_file(path: Path) -> dict:
    """The settings of an accelerate config file; a file that is not one says so in one line."""
    if path.is_dir():
        raise ValueError(
            f"accelerate config {str(path)!r} is a directory; pass the config file itself, e.g. "
            "--accelerate-config accelerate_configs/fsdp2.yaml."
        )
    if not path.is_file():
        raise ValueError(f"accelerate config {str(path)!r} does not exist; pass --accelerate-config <file.yaml>.")
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark = getattr(err, "problem_mark", None)  # yaml's own message spans several lines
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or getattr(err, "reason", None) or "unreadable"
        raise ValueError(
            f"accelerate config {str(path)!r} is not valid YAML{at}: {problem}; fix it, or write it again with "
            "`accelerate config`."
        ) from None
    if not isinstance(config, (dict, type(None))):
        raise ValueError(
            f"accelerate config {str(path)!r} holds a YAML {type(config).__name__}, not a mapping of settings; "
            "it needs keys such as distributed_type: FSDP and fsdp_config, as `accelerate config` writes."
        )
    return config or {}
