"""The whole optimizer step's peak bytes per rank, per estimate row, from the model config alone.

`StepForecaster` runs a row's step under `FakeTensorMode` in a fake process group of the launch's
world size (shapes and dtypes, no storage), on the model sharded by accelerate's own code
(fake_shard.py), inside torch's `FSDPMemTracker`: optimizer state created as a step leaves it,
then min(M, 2) micro-batches of forward+backward with the row's FSDP2 flags (held units skip the
sync of the non-final micro-batch, windowed units stay unsharded, as runtime/fsdp.py sets them),
then the optimizer step; it reads the tracker's peak per phase. Rows with the same schedule share
one run. A model of more than 2 layers runs with 1 and 2 and each phase is extrapolated linearly
(identical layers: every byte of a phase is a + b x layers). A plan that treats some layers one
way and the rest another cannot be run with fewer layers: it is computed from per_micro_batch's
step and says so. GRPO's generation (`max_completion_length`) is a phase of its own, decoded on the
fake model token by token with its KV cache; without it, a row that gathers for generation names
the KV cache in `unmodeled`, never leaving it out silently.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat.releases import kv_cache_name
from accel_gradsync.config.settings import GradSyncConfig, SyncMode, reduce_dtype_for
from accel_gradsync.estimator.fake_shard import fake_world, shard_like_accelerate
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec, StepShape
from accel_gradsync.estimator.meta_model import build_accelerate_plugin, build_meta_model
from accel_gradsync.estimator.row_costs import count_sharded_grad_bytes
from accel_gradsync.planning.units import GRADIENT_SYNC, Plan
from accel_gradsync.runtime.fsdp import ModelAdapter, adapt_model

PHASES = ("first_micro_batch", "later_micro_batch", "optimizer_step")
_INDEXED = re.compile(r"^(.*)\.(\d+)$")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class Schedule:
    """What one simulated step holds, by unit key (a unit's name with a trailing layer index as
    `*`, so it names the same units in the model with fewer layers): the units whose sync the
    non-final micro-batches skip (`held_sync`: `gradient_sync`, or on HSDP only the `all_reduce`),
    and the windowed units whose params stay unsharded from the window's first forward to its last
    backward (runtime/fsdp.py's `hold` and `keep_params_through_forward`)."""

    mode: str
    held: frozenset[str] = frozenset()
    windowed: frozenset[str] = frozenset()
    held_sync: str = GRADIENT_SYNC


@dataclass
class SimulatedStep:
    """One simulated step's peaks per phase (bytes per rank) and, at the later (else the first)
    micro-batch's peak, the tracker's categories."""

    phases: dict[str, int]
    sharded_params: int
    optimizer_state: int
    activations: int
    """Everything else live at that peak: activations, temporaries, inputs, unsharded params and
    gradients, all-gather and reduce-scatter buffers."""


@dataclass
class StepPeak:
    """A row's forecast: the peak, the phase it falls in, its parts, and what it leaves out."""

    peak_bytes: int
    phase: str
    parts: dict[str, int] = field(default_factory=dict)
    unmodeled: list[str] = field(default_factory=list)


def count_layers(model_config: Any) -> int | None:
    """The config's decoder layer count, or None for a config that names it otherwise."""
    for key in _LAYER_KEYS:
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def with_layers(model_config: Any, layers: int) -> Any:
    """`model_config` with `layers` decoder layers (per-layer lists cut to match)."""
    values = model_config.to_dict()
    for key in _LAYER_KEYS:
        if key in values:
            values[key] = layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(values.get(key), list):
            values[key] = values[key][:layers]
    return type(model_config).from_dict(values)


def unit_key(name: str) -> str:
    """`model.layers.7` -> `model.layers.*`; other names as they are."""
    match = _INDEXED.match(name)
    return f"{match.group(1)}.*" if match else name


class StepForecaster:
    """The step peak of every row of one estimate: one simulated step per distinct schedule
    (per_micro_batch, full deferral, the full window, ...), each run once and reused."""

    def __init__(
        self,
        model_config: Any,
        model_dtype: torch.dtype,
        setup: FSDPSetup,
        config: GradSyncConfig,
        shape: StepShape,
        micro_batches: int,
        lora: LoraSpec | None = None,
    ) -> None:
        if setup.fsdp_version != 2 or setup.distributed_config:
            raise ValueError(
                "--micro-batch-size/--seq-len: the step forecast runs torch's FSDPMemTracker, which tracks FSDP2 "
                "(fully_shard) as accelerate shards it only; use fsdp_version: 2 in the accelerate config, or drop "
                "--micro-batch-size/--seq-len."
            )
        if setup.hsdp:
            raise ValueError(
                "--micro-batch-size/--seq-len: the step forecast does not run HSDP meshes yet (its fake step fails on "
                "them with a shape error in this torch); drop the two flags, or forecast one "
                f"replica: the config without parallelism_config and --num-processes {setup.shard_size}."
            )
        if shape.num_generations:
            total = shape.generation_batch(micro_batches) * setup.num_processes
            if total % shape.num_generations:
                raise ValueError(
                    f"--num-generations={shape.num_generations}: TRL needs the generation batch (micro-batch-size x "
                    f"micro-batches x processes = {total}) to be a multiple of it; pass a divisor of {total}."
                )
        self.model_config, self.model_dtype, self.setup, self.config = model_config, model_dtype, setup, config
        self.shape, self.micro_batches, self.lora = shape, micro_batches, lora
        self.layers = count_layers(model_config)
        self.simulated: dict[Schedule, SimulatedStep] = {}
        self.generations: dict[bool, int] = {}

    def simulate(self, schedule: Schedule) -> SimulatedStep:
        """`schedule`'s step: run as it is for a model of at most 2 layers, else extrapolated
        from 1 and 2 layers, phase by phase (each is a + b x layers)."""
        if schedule not in self.simulated:
            layers = self.layers
            if layers is None or layers <= 2:
                self.simulated[schedule] = self._run_or_explain(self.model_config, schedule)
            else:
                one, two = (self._run_or_explain(with_layers(self.model_config, n), schedule) for n in (1, 2))

                def extend(a: int, b: int) -> int:
                    return a + (layers - 1) * (b - a)

                self.simulated[schedule] = SimulatedStep(
                    phases={p: extend(one.phases[p], two.phases[p]) for p in one.phases},
                    sharded_params=extend(one.sharded_params, two.sharded_params),
                    optimizer_state=extend(one.optimizer_state, two.optimizer_state),
                    activations=extend(one.activations, two.activations),
                )
        return self.simulated[schedule]

    def simulate_generation(self, gathered: bool) -> int:
        """The generation phase's peak (`--max-completion-length`), units kept gathered or not: as
        `simulate`, whole or extrapolated from 1 and 2 layers."""
        if gathered not in self.generations:
            layers = self.layers
            if layers is None or layers <= 2:
                self.generations[gathered] = self._generate_or_explain(self.model_config, gathered)
            else:
                one, two = (self._generate_or_explain(with_layers(self.model_config, n), gathered) for n in (1, 2))
                self.generations[gathered] = one + (layers - 1) * (two - one)
        return self.generations[gathered]

    def row(self, plan: Plan, adapter: ModelAdapter, mode: str) -> StepPeak:
        """Row `plan`'s peak: the simulated step of its schedule. A plan that treats some of a
        model's layers one way and the rest another (budget, auto) is simulated as it is when the
        model is simulated whole; with extrapolated layers, from per_micro_batch's step with the held
        units' sharded gradients swapped for what the plan holds (planning's byte counts), and
        says so in `unmodeled`. Generation (`gather_for_generation`) is a phase of its own: the
        sharded params, the optimizer state and the gathered params."""
        unmodeled: list[str] = []
        chosen = self.config.resolved().reduce_dtype
        if self.setup.mixed_precision == "no" or reduce_dtype_for(mode, chosen) == chosen:
            mode = SyncMode.PER_MICRO_BATCH  # the same sharded model: one simulation serves both
        schedule = self._schedule(plan, adapter, mode)
        if schedule is not None:
            sim = self.simulate(schedule)
            phases = dict(sim.phases)
        else:
            sim = self.simulate(Schedule(mode))
            all_sharded = count_sharded_grad_bytes(Plan(SyncMode.PER_MICRO_BATCH), adapter)
            held_sharded = all_sharded - count_sharded_grad_bytes(plan, adapter)
            phases = dict(sim.phases)
            phases["first_micro_batch"] += plan.held_param_bytes()
            if "later_micro_batch" in phases:
                phases["later_micro_batch"] += plan.held_bytes() - held_sharded
            unmodeled.append(
                "a plan that holds only some layers, with layers extrapolated: its held bytes are added to the "
                "per_micro_batch step (not simulated)"
            )
        if self.shape.max_completion_length:
            phases["generation"] = self.simulate_generation(gathered=plan.generation_bytes > 0)
        elif plan.generation_bytes:
            phases["generation"] = sim.sharded_params + sim.optimizer_state + plan.generation_bytes
            unmodeled.append(
                "generation's KV cache and activations (the generation phase counts only the gathered params; "
                "--max-completion-length simulates them)"
            )
        phase = max(phases, key=lambda p: phases[p])
        all_sharded = count_sharded_grad_bytes(Plan(SyncMode.PER_MICRO_BATCH), adapter)
        parts = {
            "sharded_params": sim.sharded_params,
            "optimizer_state": sim.optimizer_state,
            "sharded_grads": count_sharded_grad_bytes(plan, adapter) if plan.held else all_sharded,
            "held_grads": plan.held_grad_bytes(),
            "held_params": plan.held_param_bytes(),
            "activations": sim.activations,
            "generation_params": plan.generation_bytes,
            **({"generation_peak": phases["generation"]} if "generation" in phases else {}),
        }
        return StepPeak(peak_bytes=int(phases[phase]), phase=phase, parts=parts, unmodeled=unmodeled)

    def _schedule(self, plan: Plan, adapter: ModelAdapter, mode: str) -> Schedule | None:
        """`plan` as a `Schedule` by unit key; None where keys would merge layers it treats
        differently and the model is simulated with fewer layers."""
        held = {unit_key(u.name) for u in plan.held}
        windowed = {unit_key(u.name) for u in plan.windowed}
        whole = self.layers is None or self.layers <= 2
        if not whole:
            for u in adapter.units:
                key = unit_key(u.name)
                if (key in held) != any(h is u for h in plan.held):
                    return None
                if (key in windowed) != any(w is u for w in plan.windowed):
                    return None
        else:
            held, windowed = {u.name for u in plan.held}, {u.name for u in plan.windowed}
        return Schedule(mode, frozenset(held), frozenset(windowed), plan.held_sync if plan.held else GRADIENT_SYNC)

    def _run_or_explain(self, model_config: Any, schedule: Schedule) -> SimulatedStep:
        """`_run`, with a failure of the fake step (a model or setting that torch's fake tensors or
        tracker cannot run) as the one-line `ValueError` the CLI prints."""
        return self._explain(model_config, lambda: self._run(model_config, schedule))

    def _generate_or_explain(self, model_config: Any, gathered: bool) -> int:
        return self._explain(model_config, lambda: self._generate(model_config, gathered))

    def _explain(self, model_config: Any, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except (RuntimeError, NotImplementedError, TypeError, AssertionError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(
                f"--micro-batch-size/--seq-len: the step forecast could not run {model_config.model_type} on fake "
                f"tensors ({type(err).__name__}: {first}); drop the two flags for the estimate without it."
            ) from None

    @contextlib.contextmanager
    def _tracked_model(
        self, model_config: Any, mode: str, checkpointing: bool
    ) -> Iterator[tuple[torch.nn.Module, ModelAdapter, torch.optim.Optimizer, Any]]:
        """`model_config`'s model sharded as accelerate shards it for `mode`, on fake tensors in a
        fake world, with the optimizer state a step after the first holds, inside `FSDPMemTracker`."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        setup = self.setup
        with fake_world(setup.num_processes):
            model = build_meta_model(model_config, self.model_dtype, self.lora)
            head = getattr(model, "get_output_embeddings", None)
            if head is None or head() is None:
                raise ValueError(
                    f"--model: {type(model).__name__} is not a causal LM; the step forecast runs a causal-LM "
                    "forward with labels. Pass a causal-LM config, or drop --micro-batch-size/--seq-len."
                )
            if checkpointing:
                enable_checkpointing(model)
            model.train()
            plugin = build_accelerate_plugin(setup, self.config, model, mode)
            model = shard_like_accelerate(model, plugin, setup.mixed_precision, setup.replicate_size, setup.shard_size)
            adapter = adapt_model(model)
            assert adapter is not None  # fully_shard wrapped the root
            with FakeTensorMode(allow_non_fake_inputs=True):
                model.to_empty(device="cpu")
                params = [p for p in model.parameters() if p.requires_grad]
                optimizer = _build_optimizer(self.shape.optimizer, params)
                tracker = FSDPMemTracker(model, optimizer)
                with tracker:
                    for p in params:  # the state a step after the first holds (AdamW: both moments)
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                yield model, adapter, optimizer, tracker

    def _generate(self, model_config: Any, gathered: bool) -> int:
        """GRPO's generation on the fake model: one rank's generation batch, prompt prefilled with
        only the last position's logits, then one token at a time with the KV cache, as
        transformers' `generate` decodes (TRL turns gradient checkpointing off for it); with
        `gathered`, every unit stays unsharded from its first forward on, as
        `gather_for_generation` keeps it. The tracker's peak over the loop."""
        shape = self.shape
        batch, prompt = shape.generation_batch(self.micro_batches), shape.seq_len - shape.max_completion_length
        with self._tracked_model(model_config, self.config.mode, checkpointing=False) as (model, adapter, _, tracker):
            if gathered:
                for unit in adapter.units:
                    cast(FSDPModule, unit.module).set_reshard_after_forward(False, recurse=False)
            with tracker, torch.no_grad():
                ids = torch.randint(0, model_config.vocab_size, (batch, prompt))
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                kv = kv_cache_name()  # `cache` from transformers 5.24, `past_key_values` before
                cache = getattr(out, kv)
                for _ in range(shape.max_completion_length - 1):
                    token = torch.softmax(out.logits[:, -1, :].float(), dim=-1).argmax(-1, keepdim=True)
                    del out
                    tracker.reset_mod_stats()  # the root's next forward (a PEFT root refuses it); the peak is kept
                    out = model(input_ids=token, use_cache=True, **{kv: cache})
                    cache = getattr(out, kv)
                del out, cache
                return _total(tracker.get_tracker_snapshot("peak"))

    def _run(self, model_config: Any, schedule: Schedule) -> SimulatedStep:
        """The tracked fake step of the module docstring, for `model_config` as given."""
        shape = self.shape
        whole = model_config is self.model_config
        tracked = self._tracked_model(model_config, schedule.mode, shape.gradient_checkpointing)
        with tracked as (model, adapter, optimizer, tracker):
            name = (lambda n: n) if whole else unit_key
            held = [cast(FSDPModule, u.module) for u in adapter.units if name(u.name) in schedule.held]
            windowed = [cast(FSDPModule, u.module) for u in adapter.units if name(u.name) in schedule.windowed]
            phases: dict[str, int] = {}
            count = min(self.micro_batches, 2)  # micro-batches after the second repeat the second
            for k, phase in enumerate(PHASES[:count] if count == 2 else PHASES[:1]):
                last = k == count - 1
                for module in held:
                    if schedule.held_sync == GRADIENT_SYNC:
                        module.set_requires_gradient_sync(last, recurse=False)
                    else:
                        module.set_requires_all_reduce(last, recurse=False)
                for module in windowed:
                    module.set_reshard_after_forward(False, False)
                    module.set_reshard_after_backward(last, recurse=False)
                tracker.reset_mod_stats()  # per-module stats refuse a second iteration; the peak is kept
                with tracker:  # entering again starts the peak from what is live now
                    ids = torch.randint(0, model_config.vocab_size, (shape.micro_batch_size, shape.seq_len))
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    del ids
                    phases[phase] = _total(tracker.get_tracker_snapshot("peak"))
                    snapshot = tracker.get_tracker_snapshot("peak")
            with tracker:
                optimizer.step()
                phases["optimizer_step"] = _total(tracker.get_tracker_snapshot("peak"))
                optimizer.zero_grad(set_to_none=True)
        persistent = ("Sharded Param", "OptState", "Sharded Grad", "Buffer")
        return SimulatedStep(
            phases=phases,
            sharded_params=_category(snapshot, "Sharded Param"),
            optimizer_state=_category(snapshot, "OptState"),
            activations=_total(snapshot) - sum(_category(snapshot, c) for c in persistent),
        )


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, as a run would switch it on
    (`activation_checkpointing_enable`; before transformers 5.x `gradient_checkpointing_enable`)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        legacy: Any = model
        legacy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _build_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3)


def _total(snapshot: dict) -> int:
    return max((int(dev.get("Total", 0)) for dev in snapshot.values()), default=0)


def _category(snapshot: dict, name: str) -> int:
    values = (int(v) for dev in snapshot.values() for k, v in dev.items() if getattr(k, "value", k) == name)
    return max(values, default=0)
