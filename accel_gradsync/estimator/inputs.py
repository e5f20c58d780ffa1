"""The estimate's inputs: the launch (an accelerate config file, or the `DistributedConfig` keys of a
model transformers shards at load time) read into an `FSDPSetup`, and the model's transformers config.

`accelerate launch` reads the same file through environment variables; `FSDPSetup` keeps only the
keys that decide units, dtypes and mesh. Every bad input is a one-line `ValueError` naming the file
or flag, the value and what to set: the CLI prints it as its error line.
"""

from __future__ import annotations

import json
import os
import re
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

MAX_MICRO_BATCHES = 10**12
"""Micro-batches per optimizer step the estimate takes: far above any run's gradient accumulation
(the counts are closed forms in M, and test_core.py estimates 10^11 at once), and M x units
collectives per step stay within a 64-bit integer."""
MAX_PROCESSES = 100_000
"""Processes (and each mesh dimension): torch's `fully_shard` makes one shard record per rank and
parameter, so sharding takes time in proportion to processes x parameters (the recipe's model
over 100,000 processes: about 30 s on 2 CPU cores; a 7B model several minutes)."""
MAX_MICRO_BATCH_SIZE = 100_000
"""Sequences per micro-batch for the step forecast."""
MAX_SEQ_LEN = 10_000_000
"""Tokens per sequence for the step forecast: the longest context windows models ship with."""
MAX_LORA_R = 100_000
"""LoRA rank: above any model's hidden size, so above any rank that trains fewer parameters than
the layer it adapts."""

OPTIMIZERS = ("adamw", "sgd")
"""What the step forecast can build: AdamW (two moments in the params' dtype) and plain SGD (no state)."""
_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DISTRIBUTED_KEYS = ("fsdp_size", "dp_replicate_size", "fsdp_mixed_precision", "fsdp_cpu_offload", "fsdp_plan")


def check_count(setting: str, value: Any, what: str, high: int | None, low: int = 1) -> int:
    """`value` as an int from `low` to `high` (None: no upper bound), or a one-line `ValueError`
    naming `setting` (a flag, or a file and key) and the value, and saying the range. `what` is what
    is counted, e.g. "micro-batches per optimizer step". A bool, a float or text that is not a
    whole number is refused, not rounded."""
    whole = value if isinstance(value, int) and not isinstance(value, bool) else None
    if whole is None and isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        whole = int(value)
    span = f"from {low:,} to {high:,}" if high is not None else f"at least {low:,}"
    if whole is None:
        raise ValueError(f"{setting}={value!r} is not a whole number; give {span} {what}.")
    if whole < low:
        raise ValueError(f"{setting}={whole}: needs at least {low:,}; give {span} {what}.")
    if high is not None and whole > high:
        raise ValueError(f"{setting}={whole}: more than the estimate takes; give at most {high:,} {what}.")
    return whole


def check_micro_batches(micro_batches: int) -> int:
    """The CLI's `--micro-batches` M, from 1 to `MAX_MICRO_BATCHES`."""
    what = "micro-batches per optimizer step (gradient_accumulation_steps)"
    return check_count("--micro-batches", micro_batches, what, MAX_MICRO_BATCHES)


def check_processes(setting: str, processes: Any) -> int:
    """A number of processes (`--num_processes`, or a config's key), from 1 to `MAX_PROCESSES`."""
    return check_count(setting, processes, "processes, as for accelerate launch", MAX_PROCESSES)


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
    if not isinstance(fsdp, dict):
        raise ValueError(f"{where}: fsdp_config={fsdp!r} is not a mapping; give its keys, e.g. fsdp_version: 2.")
    version = fsdp.get("fsdp_version", 1)
    if str(version) not in ("1", "2"):
        raise ValueError(f"{where}: fsdp_version={version!r}; valid choices: 1, 2 (accelerate's FSDP1 and FSDP2).")
    version = int(version)
    if num_processes is not None:
        processes = check_processes("--num_processes", num_processes)
    else:
        processes = check_processes(f"{where}: num_processes", config.get("num_processes", 1))
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
    if not isinstance(parallel, dict):
        raise ValueError(
            f"{where}: parallelism_config={parallel!r} is not a mapping; give its keys, e.g. "
            "parallelism_config_dp_replicate_size: 2."
        )
    mesh = "processes along this mesh dimension"
    key = "parallelism_config_dp_replicate_size"
    replicate = check_count(f"{where}: {key}", parallel.get(key, 1), mesh, MAX_PROCESSES)
    key = "parallelism_config_dp_shard_size"
    shard = check_count(f"{where}: {key}", parallel.get(key, processes // replicate), mesh, MAX_PROCESSES)
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
        min_num_params=check_count(
            f"{where}: fsdp_min_num_params", fsdp.get("fsdp_min_num_params", 0), "parameters", None, low=0
        ),
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
    mesh = "processes along this mesh dimension"
    sizes = {key: keys.get(key) for key in ("dp_replicate_size", "fsdp_size")}
    replicate, shard = (
        1 if value is None else check_count(f"--distributed-config: {key}", value, mesh, MAX_PROCESSES)
        for key, value in sizes.items()
    )
    check_processes("--distributed-config: fsdp_size x dp_replicate_size", replicate * shard)
    if replicate * shard < 2:
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
        check_count("--micro-batch-size", self.micro_batch_size, "sequences per micro-batch", MAX_MICRO_BATCH_SIZE)
        check_count("--seq-len", self.seq_len, "tokens per sequence", MAX_SEQ_LEN)
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
        check_count("--lora-r", self.r, "as the LoRA rank", MAX_LORA_R)


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
    of config keys with `model_type`, a local directory/config.json, or a hub name (online only).
    Whatever cannot be read is one line naming `--model`, the value and what to pass instead: a path
    that is not there, a config.json that is not a JSON object, an architecture this transformers
    does not know, a hub name the hub does not give (offline included)."""
    from transformers import AutoConfig

    if spec == RECIPE_DEFAULT:
        spec = RECIPE_DEFAULT_MODEL
    if isinstance(spec, dict):
        kwargs = dict(spec)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError("a model config dict needs a `model_type` key, e.g. {'model_type': 'qwen2', ...}.")
        _check_model_type("the model config dict", model_type)
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except _refusals() as err:
            raise ValueError(
                f"the model config dict: transformers refuses it ({_one_line(err)}); fix that key."
            ) from None
    where, instead = f"--model {spec!r}", _PASS_INSTEAD
    if not spec.strip():
        raise ValueError(f"{where} names no model; pass {instead}")
    path = Path(spec).expanduser()
    if path.exists():
        keys = _read_local_config(where, path)
        if "model_type" in keys:
            _check_model_type(where, keys["model_type"], custom="auto_map" in keys)
        refused: tuple[type[Exception], ...] = (OSError, *_refusals())
        try:
            return AutoConfig.from_pretrained(str(path))
        except refused as err:
            if "model_type" not in keys:  # transformers looked for an architecture in the path's name
                raise ValueError(
                    f'{where}: its config.json has no model_type; add one (e.g. "model_type": "llama"), or pass '
                    f"{instead}"
                ) from None
            raise ValueError(
                f"{where}: transformers refuses its config.json ({_one_line(err)}); fix that key, or pass {instead}"
            ) from None
    if path.suffix == ".json" or not _is_hub_name(spec):
        what = "file" if path.suffix == ".json" else "directory"
        raise ValueError(f"{where}: no such {what}; pass {instead}")
    return _load_hub_config(where, spec)


_PASS_INSTEAD = (
    f"a directory holding a transformers config.json (or that file), a hub name such as Qwen/Qwen2-7B (needs "
    f"network access), or {RECIPE_DEFAULT!r}."
)


def _read_local_config(where: str, path: Path) -> dict:
    """The keys of the config.json at `path` (the file, or a directory holding it)."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        # transformers would report a missing `model_type` key, as if there were a config.json.
        raise ValueError(f"{where}: the directory holds no config.json; pass {_PASS_INSTEAD}")
    try:
        keys = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: {str(file)!r} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); fix it, "
            f"or pass {_PASS_INSTEAD}"
        ) from None
    except (UnicodeDecodeError, OSError) as err:
        problem = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else err.strerror
        raise ValueError(f"{where}: cannot read {str(file)!r} ({problem}); pass {_PASS_INSTEAD}") from None
    if not isinstance(keys, dict):
        kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
        kind = "null" if keys is None else kinds[type(keys)]
        raise ValueError(
            f"{where}: {str(file)!r} holds {kind}, not a JSON object of config keys; pass a transformers "
            f"config.json (keys such as model_type and hidden_size), or {RECIPE_DEFAULT!r}."
        )
    return keys


def _check_model_type(where: str, model_type: Any, custom: bool = False) -> None:
    """Refuse, in one line, a `model_type` this transformers has no config class for (its own
    message spans four lines, or lists every architecture)."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    code = " (its auto_map names custom code, which the estimate does not run)" if custom else ""
    raise ValueError(
        f"{where}: model_type={model_type!r} is not an architecture transformers {__version__} knows{code}; use a "
        "transformers release that has it, or a config whose model_type it knows (e.g. 'llama' or 'qwen2')."
    )


def _is_hub_name(spec: str) -> bool:
    """Whether `spec` has a hub repo id's form (`name` or `namespace/name`); anything else is a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _load_hub_config(where: str, spec: str) -> Any:
    """The config of hub model `spec`, from the hub or its local cache."""
    from huggingface_hub import is_offline_mode
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(spec)
    except OSError as err:
        if is_offline_mode():
            raise ValueError(
                f"{where}: not a local directory, and HF_HUB_OFFLINE is set with no copy of its config in the hub "
                f"cache; pass a directory holding its config.json, run where the hub is reachable, or pass "
                f"{RECIPE_DEFAULT!r} (runs offline)."
            ) from None
        raise ValueError(
            f"{where}: not a local directory, and the hub gave no config for it ({_one_line(err)}); check the name "
            f"and the network, or pass a directory holding its config.json, or {RECIPE_DEFAULT!r}."
        ) from None
    except _refusals() as err:
        try:
            keys, _ = PretrainedConfig.get_config_dict(spec)  # read already: what transformers refused
        except (OSError, ValueError):
            keys = {}
        if "model_type" in keys:
            _check_model_type(where, keys["model_type"], custom="auto_map" in keys)
        raise ValueError(
            f"{where}: transformers refuses its config.json ({_one_line(err)}); pass {_PASS_INSTEAD}"
        ) from None


def _refusals() -> tuple[type[Exception], ...]:
    """What transformers raises for a config it reads but refuses: a bad value (its config classes
    are strict dataclasses of the hub client's since transformers 5), an unknown architecture."""
    from huggingface_hub import errors

    strict = getattr(errors, "StrictDataclassError", None)
    return (ValueError, TypeError, *([strict] if strict is not None else []))


def _one_line(err: BaseException) -> str:
    """An upstream error's message as one line: its lines joined, each stripped."""
    return " ".join(str(err).split()) or type(err).__name__


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
