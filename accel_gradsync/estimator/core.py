"""What each sync mode would cost, before launch: collectives, bytes sent, gradient memory held.

The units are a launched run's own. The model is built on the meta device (no weights, no
memory), sharded by accelerate's and torch's own code (`fsdp2_prepare_model` / `fully_shard`,
or `FullyShardedDataParallel` with accelerate's wrap policy) in a fake process group of the
planned world size (fake_shard.py), and read by the adapter a run reads (`fsdp.adapt_model`):
grouping, dtypes, shard padding and resharding all come from there. The very same
`policies.POLICIES` the runtime uses then plan each mode. The fake process group exists only
while the model is sharded and is destroyed after, so a real one can follow in the same process;
a process that already has one is refused.

What is still written out here, because accelerate has no function for it: reading the
accelerate config file into the plugin's settings (`accelerate launch` does it through
environment variables, `FSDPSetup` / `accelerate_plugin`). The reduce dtype is written into the
plugin's mixed-precision policy by `attach.reduce_dtype_policy`, as `attach` writes it into a live
Accelerator's plugin: per mode, since `auto` and `budget` hold fp32 where the others keep
accelerate's bf16.

Formulas, for what a run counts rather than plans (N shard ranks, R replicas on an HSDP mesh,
M micro-batches, per unit u):
- reduce-scatters per step: M per unit, 1 for a unit whose gradient sync is held;
  HSDP all-reduces: the same, and also 1 for a unit whose all-reduce only is held.
- bytes a rank sends per step: (N-1)/N x numel x sizeof(reduce dtype) per reduce-scatter
  (ring), 2(R-1)/R x that unsharded size / N per HSDP all-reduce.
- held bytes: `Plan.held_grad_bytes()` (numel x sizeof(held dtype) per held unit) and
  `Plan.held_param_bytes()` (numel x sizeof(compute dtype) per windowed unit).
- peak: see `peak_grad_bytes`; all-gathers: `policies.all_gathers_per_step`, the runtime's own,
  over every unit, frozen ones included (a frozen unit reduces nothing but all-gathers).
- generation (`gather_for_generation`): every unit's unsharded params (compute dtype) held while
  generating, `Plan.generation_bytes`; budget and auto plan with it; one all-gather per unit per
  round instead of one per resharding unit per token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from accel_gradsync.config.settings import GradSyncConfig, SyncMode, dtype_name, reduce_dtype_for
from accel_gradsync.estimator.fake_shard import fake_world, shard_like_accelerate, shard_like_transformers
from accel_gradsync.planning.costs import (
    all_gathers_per_step,
    collectives_per_step,
    format_bytes,
    generation_all_gathers_per,
)
from accel_gradsync.planning.policies import POLICIES, DeferredSync, SyncPolicy
from accel_gradsync.planning.units import ALL_REDUCE, Plan
from accel_gradsync.runtime.fsdp import ModelAdapter, adapt_model

RECIPE_DEFAULT = "recipe-default"
WINDOW_ROW = "deferred+window"
"""The row for deferral with every unit windowed (`keep_params_unsharded`), shown whatever is selected."""
ONE_PROCESS = (
    "one process: nothing to sync between ranks (FSDP sends nothing over one rank), so attach does nothing "
    "and every mode runs the same"
)
_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")


# -- the accelerate config ------------------------------------------------------------------------
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


def read_accelerate_config(
    source: str | os.PathLike | dict, num_processes: int | None = None, mixed_precision: str | None = None
) -> FSDPSetup:
    """An `FSDPSetup` from an accelerate config file (YAML/JSON) or the same keys as a dict.
    `num_processes` and `mixed_precision` override the file's, as the same flags of
    `accelerate launch` do."""
    if isinstance(source, dict):
        config, where = source, "the accelerate config"
    else:
        config, where = _load_config_file(Path(source)), str(source)
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


_DISTRIBUTED_KEYS = ("fsdp_size", "dp_replicate_size", "fsdp_mixed_precision", "fsdp_cpu_offload", "fsdp_plan")


def read_distributed_config(source: str | os.PathLike | dict) -> FSDPSetup:
    """An `FSDPSetup` for a model transformers shards at load time, from the keys of its
    `DistributedConfig` (a dict, JSON text, or a JSON/YAML file): FSDP2 over `fsdp_size` ranks,
    HSDP with `dp_replicate_size` > 1. Tensor, pipeline and expert parallelism are refused."""
    keys: Any
    if isinstance(source, dict):
        keys = dict(source)
    else:
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


def _load_config_file(path: Path) -> dict:
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


# -- the model, on the meta device -----------------------------------------------------------------
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


def build_meta_model(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `config` with every parameter on the meta device: shapes, no storage."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # not a causal LM (encoders, vision towers): the bare model
            return AutoModel.from_config(config, dtype=dtype)


# -- units, as accelerate wraps them ---------------------------------------------------------------
def accelerate_plugin(setup: FSDPSetup, config: GradSyncConfig, model: nn.Module, mode: str | None = None) -> Any:
    """accelerate's `FullyShardedDataParallelPlugin` as a launch with `setup` builds it: its wrap
    policy resolved on `model`, the mixed precision set as `AcceleratorState` sets it, and the
    reduce dtype of sync mode `mode` (default: the config's) written into it as `attach` does
    before `prepare` (`config.reduce_dtype_for`: fp32 for auto and budget when `auto`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accel_gradsync.planning.costs import reduce_dtype_policy  # what attach writes, written the same way

    fsdp1 = setup.fsdp_version == 1
    # A launch hands FSDP1's strategy over in FSDP_SHARDING_STRATEGY, without the deprecation
    # notice accelerate logs when `sharding_strategy` is passed directly.
    log = logging.getLogger("accelerate.utils.dataclasses")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=setup.fsdp_version,
            auto_wrap_policy=setup.auto_wrap_policy.lower(),
            transformer_cls_names_to_wrap=list(setup.layer_cls_to_wrap) if setup.layer_cls_to_wrap else None,
            min_num_params=setup.min_num_params,
            sharding_strategy=("FULL_SHARD" if setup.reshard_after_forward else "SHARD_GRAD_OP") if fsdp1 else None,
            reshard_after_forward=None if fsdp1 else setup.reshard_after_forward,
            use_orig_params=setup.use_orig_params if fsdp1 else None,
            # Settings the estimate does not read from the config: fixed, not taken from FSDP_* variables.
            cpu_offload=False,
            activation_checkpointing=False,
            sync_module_states=False if fsdp1 else None,
            forward_prefetch=False if fsdp1 else None,
        )
    finally:
        log.setLevel(level)
    plugin.cpu_ram_efficient_loading = False  # set after: passing it would write os.environ
    try:
        plugin.set_auto_wrap_policy(model)
    except ValueError as err:
        names = ",".join(plugin.transformer_cls_names_to_wrap or ())
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap={names}: {err} Use the class name of the transformer layer of "
            f"{type(model).__name__}."
        ) from None
    if setup.mixed_precision != "no":
        plugin.set_mixed_precision(setup.mixed_precision)
    policy = reduce_dtype_policy(plugin, config.resolved().reduce_dtype, mode or config.mode)
    if policy is not None:
        plugin.mixed_precision_policy = policy
    return plugin


def estimated_adapter(
    model: nn.Module, setup: FSDPSetup, config: GradSyncConfig, mode: str | None = None
) -> ModelAdapter:
    """The adapter a launched run reads its units from (`fsdp.adapt_model`, the same code), over
    `model` (meta device) sharded as accelerate would shard it for `setup` and sync mode `mode`
    (default: the config's; it decides the reduce dtype), in a fake process group of
    `setup.num_processes` ranks (fake_shard.py). `model` is wrapped in place."""
    if setup.distributed_config:
        if config.resolved().reduce_dtype != "auto":
            raise ValueError(
                f"reduce_dtype={config.reduce_dtype!r} cannot reach a model transformers shards at load time; "
                "DistributedConfig(fsdp_mixed_precision=True) gives bf16 params with an fp32 reduce, else the "
                "params' dtype is reduced."
            )
        with fake_world(setup.num_processes):
            adapter = adapt_model(shard_like_transformers(model, dict(setup.distributed_config)))
            assert adapter is not None  # fully_shard wraps the root
            return adapter
    if setup.hsdp and setup.fsdp_version != 2:
        raise ValueError("parallelism_config dp_replicate_size > 1 needs fsdp_version: 2 in the accelerate config.")
    plugin = accelerate_plugin(setup, config, model, mode)
    name, fix = type(model).__name__, _wrap_fix(model, setup)  # before fully_shard renames the classes
    with fake_world(setup.num_processes):
        try:
            wrapped = shard_like_accelerate(
                model, plugin, setup.mixed_precision, setup.replicate_size, setup.shard_size
            )
        except (ValueError, KeyError, RuntimeError) as err:  # what `accelerate launch` would fail with, at prepare()
            first = str(err).strip().splitlines()[0]  # torch appends the whole module's repr
            raise ValueError(
                f"accelerate cannot shard {name} with this config (FSDP{setup.fsdp_version}, "
                f"fsdp_auto_wrap_policy={setup.auto_wrap_policy}, {setup.replicate_size} replicas x "
                f"{setup.shard_size} shards), so a launch would fail in prepare() too: {first} {fix}"
            ) from None
        adapter = adapt_model(wrapped)
        assert adapter is not None  # wrapped by FSDP just above
        return adapter


def _wrap_fix(model: nn.Module, setup: FSDPSetup) -> str:
    """What to change in the accelerate config when accelerate cannot shard `model` with `setup`."""
    if setup.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" or setup.layer_cls_to_wrap is not None:
        return "Change the wrap policy or the parallelism_config."
    default = ",".join(sorted(getattr(model, "_no_split_modules", None) or ())) or "none"
    layers = ",".join(layer_classes(model)) or "<the class of its transformer layer>"
    return (
        f"Set fsdp_transformer_layer_cls_to_wrap: {layers} in the accelerate config's fsdp_config (without it "
        f"accelerate wraps the model's _no_split_modules: {default})."
    )


def layer_classes(model: nn.Module) -> list[str]:
    """The class names of `model`'s repeated layers, the usual FSDP units: those of its
    `_no_split_modules` that occur more than once, else the class in its longest `ModuleList`."""
    counts = Counter(type(m).__name__ for m in model.modules())
    named = sorted(c for c in getattr(model, "_no_split_modules", None) or () if counts[c] > 1)
    if named:
        return named
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return [type(max(lists, key=len)[0]).__name__] if lists else []


def sharded_dtype(adapter: ModelAdapter) -> torch.dtype:
    """dtype of the sharded parameters (and so of their sharded gradients): accelerate keeps
    trainable parameters in one dtype, fp32 whenever mixed precision is on."""
    return next((p.dtype for p in adapter.model.parameters() if p.requires_grad), torch.float32)


# -- the estimate ----------------------------------------------------------------------------------
@dataclass
class ModeEstimate:
    """One row of the table: one sync mode's cost per optimizer step, per rank."""

    mode: str
    applicable: bool = True
    reason: str = ""
    units_held: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    send_bytes: int = 0
    held_bytes: int = 0
    """Gradient bytes held per rank between micro-batches."""
    held_dtype: str = ""
    """The dtype held gradients are summed in over the micro-batches (FSDP2: the reduce dtype)."""
    held_bytes_compute_dtype: int = 0
    """The same gradients in the compute dtype where they are held wider (fp32 over bf16 compute:
    what `reduce_dtype=bf16` would hold); 0 where they are held in the compute dtype already."""
    held_param_bytes: int = 0
    """Unsharded parameter bytes the windowed units keep per rank through the window."""
    sharded_bytes: int = 0
    """Sharded gradients the units that sync every micro-batch keep between micro-batches."""
    peak_bytes: int = 0
    all_gathers: int = 0
    """Parameter all-gathers per optimizer step (forward, and backward after a reshard)."""
    all_gather_bytes: int = 0
    generation_bytes: int = 0
    """Unsharded parameter bytes per rank held while generating (`gather_for_generation`; 0 when off)."""
    generation_all_gathers: int = 0
    """All-gathers of generation: per token, or per round with `gather_for_generation`."""
    fits: bool | None = None
    """max(peak_bytes, generation_bytes + held gradients) <= free memory x (1 - memory_margin); None
    without --grad-sync-free-memory."""
    selected: bool = False


@dataclass
class Estimate:
    model: str
    wrapper: str
    num_processes: int
    shard_size: int
    replicate_size: int
    micro_batches: int
    mixed_precision: str
    reduce_dtype: str
    params: int
    units: list[dict] = field(default_factory=list)
    free_memory: int | None = None
    sharded_by: str = "accelerate"
    """Who wraps the model: "accelerate" (at prepare) or "transformers" (at load, `DistributedConfig`)."""
    compute_dtype: str = ""
    """The dtype forward and backward run in (the mixed-precision param dtype, else the model's)."""
    modes: list[ModeEstimate] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def mode(self, name: str) -> ModeEstimate:
        return next(m for m in self.modes if m.mode == name)


def send_bytes_per_step(plan: Plan, adapter: ModelAdapter, micro_batches: int, replicate: int) -> int:
    """Bytes one rank sends per optimizer step: ring reduce-scatter (N-1)/N of the unsharded
    gradient, HSDP ring all-reduce 2(R-1)/R of the shard."""
    held = {id(u) for u in plan.held}
    total = 0.0
    for u in adapter.units:
        n = u.shard_size
        rs = ar = micro_batches
        if id(u) in held:
            ar = 1
            rs = micro_batches if plan.held_sync == ALL_REDUCE else 1
        total += rs * u.collectives * u.reduce_bytes * (n - 1) / n
        if adapter.hsdp:
            total += ar * u.collectives * (u.reduce_bytes / n) * 2 * (replicate - 1) / replicate
    return int(total)


def sharded_grad_bytes(plan: Plan, adapter: ModelAdapter) -> int:
    """Sharded gradient bytes per rank that units syncing every micro-batch accumulate between
    micro-batches (about P/N x sizeof(sharded dtype) in per_micro_batch mode). An all-reduce
    hold's partial sums are sharded too, but counted in held bytes."""
    held = {id(u) for u in plan.held}
    size = sharded_dtype(adapter).itemsize
    return sum(u.sharded_numel * size for u in adapter.units if id(u) not in held)


def held_bytes_in_compute_dtype(plan: Plan) -> int:
    """The held gradients' bytes in the compute dtype, where the plan holds them in a wider reduce
    dtype (fp32 over bf16: the bf16 bytes `reduce_dtype=bf16` holds); 0 where it holds them so."""
    if plan.held_sync == ALL_REDUCE or not any(u.held_dtype.itemsize > u.compute_dtype.itemsize for u in plan.held):
        return 0
    return sum(u.numel * u.compute_dtype.itemsize for u in plan.held)


def peak_grad_bytes(plan: Plan, adapter: ModelAdapter) -> int:
    """Gradient bytes per rank at the worst moment of the first deferred micro-batch's backward:

    held bytes (every held unit's unsharded gradient, and kept params; for an HSDP all-reduce
    hold the sharded partial sums) + the sharded gradients (sharded param dtype) of the units
    that sync every micro-batch + the largest single-unit transient:
    - a held unit whose held dtype differs from the compute dtype (FSDP2 bf16 compute, fp32
      reduce): its compute-dtype gradient while `to_accumulated_grad_if_needed` casts it;
    - a unit that syncs: its unsharded gradient in compute dtype, plus its reduce-dtype copy
      when the dtypes differ, until the reduce-scatter returns.
    Activations, params and optimizer state are not gradients and are not counted."""
    held = {id(u) for u in plan.held}
    transient = 0
    for u in adapter.units:
        compute = u.numel * u.compute_dtype.itemsize
        if id(u) in held and plan.held_sync != ALL_REDUCE:
            transient = max(transient, compute if u.held_dtype != u.compute_dtype else 0)
            continue
        transient = max(transient, compute + (u.reduce_bytes if u.reduce_dtype != u.compute_dtype else 0))
    return plan.held_bytes() + sharded_grad_bytes(plan, adapter) + transient


def estimate(
    model_spec: str | dict,
    accelerate_config: str | os.PathLike | dict | None,
    micro_batches: int,
    config: GradSyncConfig | None = None,
    num_processes: int | None = None,
    model_dtype: torch.dtype = torch.float32,
    mixed_precision: str | None = None,
    distributed_config: str | os.PathLike | dict | None = None,
) -> Estimate:
    """What each sync mode would cost per optimizer step, before launch, planned by the
    runtime's own policies over the units a launched run would have.

    Args:
        model_spec (`str` or `dict`): a local directory with a transformers `config.json`, a hub
            name (online only), a dict of config keys with `model_type`, or `"recipe-default"`.
        accelerate_config (`str`, `os.PathLike`, `dict` or `None`): the accelerate config file
            (or its keys) a launch would use; `None` with `distributed_config`.
        micro_batches (`int`): M, micro-batches per optimizer step (at least 1).
        config (`GradSyncConfig`, *optional*): the sync settings; `GradSyncConfig()` by default.
        num_processes (`int`, *optional*): overrides the config's, as `accelerate launch` does.
        model_dtype (`torch.dtype`): the dtype the weights are loaded in.
        mixed_precision (`str`, *optional*): overrides the config's, as `accelerate launch` does.
        distributed_config (`str`, `os.PathLike` or `dict`, *optional*): instead of
            `accelerate_config`, the `DistributedConfig` keys of a model transformers shards at
            load time (JSON text, a JSON/YAML file, or a dict).

    Returns:
        `Estimate`: the model, mesh and units, and one `ModeEstimate` per mode of
        `policies.POLICIES` plus the `deferred+window` row.

    Raises:
        `ValueError`: an input a launch would also fail on, named with what to change (both or
            neither of the two configs, a config accelerate cannot shard, M below 1, a process
            that already has a torch.distributed group).
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: needs at least 1 micro-batch per optimizer step.")
    config = GradSyncConfig() if config is None else config
    if (accelerate_config is None) == (distributed_config is None):
        raise ValueError(
            "give exactly one of --accelerate-config (accelerate shards the model) and --distributed-config "
            "(transformers shards it at load time: from_pretrained(..., distributed_config=...))."
        )
    if distributed_config is not None:
        setup = read_distributed_config(distributed_config)
    else:
        assert accelerate_config is not None  # one of the two, checked above
        setup = read_accelerate_config(accelerate_config, num_processes, mixed_precision)
    model_config = load_model_config(model_spec)
    adapter = estimated_adapter(build_meta_model(model_config, model_dtype), setup, config)
    chosen = config.resolved().reduce_dtype
    # Units by the reduce dtype attach writes: auto and budget hold fp32 where the others keep
    # accelerate's (config.reduce_dtype_for); nothing reaches a model transformers shards.
    same = setup.distributed_config or setup.mixed_precision == "no"  # nothing, or nothing to widen
    adapters = {chosen if same else reduce_dtype_for(config.mode, chosen): adapter}

    def adapter_for(mode: str) -> ModelAdapter:
        dtype = chosen if same else reduce_dtype_for(mode, chosen)
        if dtype not in adapters:
            adapters[dtype] = estimated_adapter(build_meta_model(model_config, model_dtype), setup, config, mode)
        return adapters[dtype]

    free = config.free_memory_bytes
    result = Estimate(
        model=model_spec if isinstance(model_spec, str) else str(model_spec.get("model_type")),
        wrapper=adapter.kind,
        num_processes=setup.num_processes,
        shard_size=setup.shard_size,
        replicate_size=setup.replicate_size,
        micro_batches=micro_batches,
        mixed_precision=setup.mixed_precision,
        reduce_dtype=config.resolved().reduce_dtype,
        params=sum(u.numel for u in adapter.units),
        units=[{"name": u.name or "<root>", "numel": u.numel} for u in adapter.units],
        free_memory=free,
        sharded_by="transformers" if setup.distributed_config else "accelerate",
        compute_dtype=dtype_name(adapter.units[0].compute_dtype),  # every unit computes in it
    )
    rows: list[tuple[str, type[SyncPolicy]]] = [*POLICIES.items(), (WINDOW_ROW, DeferredSync)]
    for name, policy_cls in rows:
        windowed = config.sync_mode == SyncMode.DEFERRED and config.keep_params_unsharded
        row = ModeEstimate(name, selected=name == ("deferred+window" if windowed else config.sync_mode))
        try:
            # The deferred rows show deferral without and with the window, whatever the config says.
            window = {SyncMode.DEFERRED: False, WINDOW_ROW: True}.get(name)
            adapter = adapter_for(policy_cls.name)
            plan = _plan(policy_cls, config, adapter, free, micro_batches, window).over(micro_batches)
            if setup.num_processes == 1:
                plan = Plan(policy_cls.name, reason=ONE_PROCESS)
        except ValueError as err:
            row.applicable, row.reason = False, str(err)
            result.modes.append(row)
            continue
        rs, ar = collectives_per_step(plan, adapter.units, adapter.hsdp, micro_batches)
        label = _plan_label(plan)
        row.mode = name if label == name or name == WINDOW_ROW else f"{name} -> {label}"
        row.reason = plan.reason
        row.units_held = len(plan.held)
        row.reduce_scatters, row.all_reduces = rs, ar
        row.send_bytes = send_bytes_per_step(plan, adapter, micro_batches, setup.replicate_size)
        row.held_bytes = plan.held_grad_bytes()
        row.held_param_bytes = plan.held_param_bytes()
        row.held_dtype = dtype_name(plan.held[0].held_dtype) if plan.held else ""
        row.held_bytes_compute_dtype = held_bytes_in_compute_dtype(plan)
        if plan.held_sync == ALL_REDUCE:
            row.held_dtype += " (sharded)"
        row.sharded_bytes = sharded_grad_bytes(plan, adapter)
        row.peak_bytes = peak_grad_bytes(plan, adapter)
        row.all_gathers, row.all_gather_bytes = all_gathers_per_step(plan, adapter, micro_batches)
        row.generation_bytes = plan.generation_bytes
        row.generation_all_gathers = generation_all_gathers_per(adapter.units, kept=bool(plan.generation_bytes))
        if setup.num_processes == 1:  # FSDP2 issues no collective over one rank, FSDP1 sends nothing
            row.reduce_scatters = row.all_reduces = row.all_gathers = row.generation_all_gathers = 0
        if free is not None:
            worst = max(row.peak_bytes, row.generation_bytes + row.held_bytes)
            row.fits = worst <= int(free * (1 - config.resolved().memory_margin))
        result.modes.append(row)
    return result


def _plan(
    policy_cls: type[SyncPolicy],
    config: GradSyncConfig,
    adapter: ModelAdapter,
    free: int | None,
    micro_batches: int,
    window: bool | None = None,
) -> Plan:
    if window and adapter.kind != "fsdp2":
        raise ValueError("keeps FSDP2 units' params unsharded through the window; FSDP1's equivalent is SHARD_GRAD_OP.")
    if window is not None:
        config = dataclasses.replace(config, keep_params_unsharded=window)
    if policy_cls.name == SyncMode.BUDGET and not config.memory_budget:
        raise ValueError("needs a budget: set --grad-sync-memory-budget (e.g. 12GiB or 0.5 of free memory).")

    def free_memory() -> int:
        if free is None:
            raise ValueError(f"{policy_cls.name} needs free memory per rank: set --grad-sync-free-memory (e.g. 40GiB).")
        return free

    return policy_cls(config).plan(adapter, free_memory, micro_batches)


def _plan_label(plan: Plan) -> str:
    """What a row's plan amounts to: its mode, with the windows a deferral keeps said."""
    if plan.mode != SyncMode.DEFERRED or not plan.windowed:
        return plan.mode
    return WINDOW_ROW if len(plan.windowed) == len(plan.held) else f"deferred ({len(plan.windowed)} windowed)"


# -- output ----------------------------------------------------------------------------------------
def _held_dtype_notes(est: Estimate) -> list[str]:
    """What the held dtype means, where the model computes in less than fp32: the dtype the held
    gradients of the micro-batches are summed in, beside per_micro_batch's fp32 sums."""
    if est.compute_dtype in ("", "fp32"):
        return []
    low = est.compute_dtype
    lines = [
        f"held dtype: what held gradients are summed in over the {est.micro_batches} micro-batches. fp32 sums "
        f"as per_micro_batch does (it sums reduced shards in the fp32 params); {low} sums round more, so "
        "the gradients differ (measured in docs/modes.md)."
    ]
    if est.wrapper == "fsdp2":
        lines.append(
            f"auto and budget hold fp32 where the model computes in {low} (reduce_dtype auto; in brackets the "
            f"{low} bytes reduce_dtype=bf16 holds instead); the other modes keep accelerate's reduce dtype unless "
            "reduce_dtype is fp32."
        )
    else:
        lines.append(
            f"{est.wrapper}'s no_sync() holds the compute dtype whatever the reduce dtype: auto defers only with "
            "reduce_dtype=bf16; FSDP2 with reduce_dtype fp32 holds fp32."
        )
    return lines


def _processes(est: Estimate, mesh: str) -> str:
    if est.num_processes == 1:
        return "1 process (nothing to sync between ranks: attach does nothing, every mode runs the same)"
    return f"{est.num_processes} processes ({mesh})"


def format_table(est: Estimate) -> str:
    """The human-readable table: a header line, one row per mode, then the n/a reasons."""
    mesh = (
        f"{est.replicate_size} replicas x {est.shard_size} shards"
        if est.replicate_size > 1
        else f"{est.shard_size} shards"
    )
    lines = [
        f"model {est.model}: {est.params:,} trainable params in {len(est.units)} {est.wrapper} units "
        f"(sharded by {est.sharded_by}); {_processes(est, mesh)}; "
        f"mixed_precision={est.mixed_precision}, reduce_dtype={est.reduce_dtype}; "
        f"{est.micro_batches} micro-batches per optimizer step"
        + (f"; free memory {format_bytes(est.free_memory)}/rank" if est.free_memory is not None else ""),
        "",
    ]
    header = [
        "mode",
        "reduce-scatters/step",
        "all-reduces/step",
        "sent/rank/step",
        "held grads/rank",
        "held dtype",
        "held params/rank",
        "sharded grads/rank",
        "peak/rank",
        "fits",
        "all-gathers/step",
        "generation params/rank",
    ]
    rows, notes = [], []
    for m in est.modes:
        name = m.mode + (" *" if m.selected else "")
        if not m.applicable:
            rows.append([name, "n/a"] + [""] * (len(header) - 2))
            notes.append(f"{m.mode}: n/a: {m.reason}")
            continue
        fits = "-" if m.fits is None else ("yes" if m.fits else "NO")
        rows.append(
            [
                name,
                str(m.reduce_scatters),
                str(m.all_reduces) if est.replicate_size > 1 else "-",
                format_bytes(m.send_bytes),
                format_bytes(m.held_bytes)
                + (
                    f" ({est.compute_dtype}: {format_bytes(m.held_bytes_compute_dtype)})"
                    if m.held_bytes_compute_dtype
                    else ""
                ),
                m.held_dtype or "-",
                format_bytes(m.held_param_bytes),
                format_bytes(m.sharded_bytes),
                format_bytes(m.peak_bytes),
                fits,
                f"{m.all_gathers} ({format_bytes(m.all_gather_bytes)})",
                format_bytes(m.generation_bytes) if m.generation_bytes else "-",
            ]
        )
        if m.reason:
            notes.append(f"{m.mode}: {m.reason}")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines += ["", "* the mode GradSyncConfig selects", *notes, *_held_dtype_notes(est)]
    return "\n".join(lines)
