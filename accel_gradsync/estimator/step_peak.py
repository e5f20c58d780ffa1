"""The whole optimizer step's peak bytes per rank, per estimate row, from the model config alone.

`StepForecaster` turns a row's plan into the steps to simulate (fake_step.py runs each on fake
tensors inside torch's `FSDPMemTracker`) and the row's peak from them. Rows with the same schedule
share one run. A model of more than 2 layers runs with 1 and 2 and each phase is extrapolated
linearly (identical layers: every byte of a phase is a + b x layers). A plan that treats some
layers one way and the rest another cannot be run with fewer layers: it is computed from
per_micro_batch's step and says so. GRPO's generation (`max_completion_length`) is a phase of its
own; without it, a row that gathers for generation names the KV cache in `unmodeled`, never
leaving it out silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from accel_gradsync.config.settings import GradSyncConfig, SyncMode
from accel_gradsync.estimator.fake_step import FakeStep, Schedule, SimulatedStep, unit_key
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec, StepShape
from accel_gradsync.estimator.row_costs import count_sharded_grad_bytes
from accel_gradsync.planning.reduce_dtype import reduce_dtype_for
from accel_gradsync.planning.units import GRADIENT_SYNC, Plan
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


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


class StepForecaster:
    """The step peak of every row of one estimate: one simulated step per distinct schedule
    (per_micro_batch, full deferral, every unit windowed, ...), each run once and reused."""

    def __init__(
        self,
        model_config: Any,
        model_dtype: torch.dtype,
        setup: FSDPSetup,
        config: GradSyncConfig,
        shape: StepShape,
        micro_batches: int,
        lora: LoraSpec | None = None,
        use_vllm: bool = False,
    ) -> None:
        """`use_vllm`: TRL's, where vLLM generates and the trained model does not: no generation
        phase (vLLM's memory is its own), whatever `shape.max_completion_length` says."""
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
        self.model_config, self.setup, self.config, self.shape = model_config, setup, config, shape
        self.use_vllm = use_vllm
        self.fake_step = FakeStep(model_dtype, setup, config, shape, micro_batches, lora)
        self.layers = count_layers(model_config)
        self.simulated: dict[Schedule, SimulatedStep] = {}
        self.generations: dict[bool, int] = {}

    def simulate(self, schedule: Schedule) -> SimulatedStep:
        """`schedule`'s step: run as it is for a model of at most 2 layers, else extrapolated
        from 1 and 2 layers, phase by phase (each is a + b x layers)."""
        if schedule not in self.simulated:
            layers = self.layers
            if layers is None or layers <= 2:
                self.simulated[schedule] = self.fake_step.run(self.model_config, schedule, whole=True)
            else:
                one, two = (self.fake_step.run(with_layers(self.model_config, n), schedule, False) for n in (1, 2))

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
                self.generations[gathered] = self.fake_step.generate(self.model_config, gathered)
            else:
                one, two = (self.fake_step.generate(with_layers(self.model_config, n), gathered) for n in (1, 2))
                self.generations[gathered] = one + (layers - 1) * (two - one)
        return self.generations[gathered]

    def row(self, plan: Plan, adapter: ModelAdapter, mode: str, running: ModelAdapter | None = None) -> StepPeak:
        """Row `plan`'s peak: the simulated step of its schedule. A plan that treats some of a
        model's layers one way and the rest another (budget, auto) is simulated as it is when the
        model is simulated whole; with extrapolated layers, from per_micro_batch's step with the held
        units' sharded gradients swapped for what the plan holds (planning's byte counts), and
        says so in `unmodeled`. Generation (`gather_for_generation`) is a phase of its own: the
        sharded params, the optimizer state and the gathered params. `running`: the same model
        under this process's torch where `adapter`'s units follow another series' dtype rules
        (`--torch`): the simulation holds this torch's dtype, so the later micro-batch's phase
        gets the difference, and `unmodeled` says the rest is this torch's FSDP2."""
        unmodeled: list[str] = []
        chosen = self.config.resolved().reduce_dtype
        if self.setup.mixed_precision == "no" or reduce_dtype_for(mode, chosen) == chosen:
            mode = SyncMode.PER_MICRO_BATCH  # the same sharded model: one simulation serves both
        schedule = self._schedule(plan, adapter, mode)
        resident = sum(u.param_bytes for u in adapter.units if u.resident)  # keep_frozen_unsharded's
        activations_less = 0
        if schedule is not None:
            sim = self.simulate(schedule)
            phases = dict(sim.phases)
            activations_less = resident  # simulated: the tracker counts them among the other live bytes
        else:
            sim = self.simulate(Schedule(mode))
            all_sharded = count_sharded_grad_bytes(Plan(SyncMode.PER_MICRO_BATCH), adapter)
            held_sharded = all_sharded - count_sharded_grad_bytes(plan, adapter)
            phases = dict(sim.phases)
            beyond = resident_beyond_window(plan, adapter)  # a windowed kept unit is in held_param_bytes already
            phases["first_micro_batch"] += plan.held_param_bytes() + beyond
            if "later_micro_batch" in phases:
                phases["later_micro_batch"] += plan.held_bytes() - held_sharded + beyond
            phases["optimizer_step"] += resident
            unmodeled.append(
                "a plan that treats only some layers so (held, windowed or kept frozen), with layers extrapolated: "
                "its held bytes and kept frozen units are added to the per_micro_batch step (not simulated; a kept "
                "unit the step gathers anyway is counted twice at that moment)"
            )
        if self.use_vllm:
            unmodeled.append(
                "vLLM's generation (use_vllm: its memory is its own) and TRL's weight sync, which reads each "
                "parameter whole once per step"
            )
        elif self.shape.max_completion_length:
            gathered = plan.generation_bytes > 0
            # Gathered for generation, the kept units are among every unit's params already.
            phases["generation"] = self.simulate_generation(gathered) + (0 if gathered else resident)
            if resident and not gathered:
                unmodeled.append(
                    "generation beside the kept frozen units: their bytes are added to the simulated generation "
                    "(not simulated with them kept)"
                )
        elif plan.generation_bytes:
            phases["generation"] = sim.sharded_params + sim.optimizer_state + plan.generation_bytes
            unmodeled.append(
                "generation's KV cache and activations (the generation phase counts only the gathered params; "
                "--max-completion-length simulates them)"
            )
        if running is not None:
            delta = plan.held_grad_bytes() - _on(plan, adapter, running).held_grad_bytes()
            if delta and "later_micro_batch" in phases:
                phases["later_micro_batch"] += delta
            unmodeled.append(
                f"simulated by this process's torch {torch.__version__}, not by the cluster's: the all-gather and "
                "reduce-scatter buffers and casts are this torch's FSDP2's"
                + (f"; the held gradients are counted in the cluster's dtype ({delta:+,} B)" if delta else "")
            )
        phase = max(phases, key=lambda p: phases[p])
        all_sharded = count_sharded_grad_bytes(Plan(SyncMode.PER_MICRO_BATCH), adapter)
        parts = {
            "sharded_params": sim.sharded_params,
            "optimizer_state": sim.optimizer_state,
            "sharded_grads": count_sharded_grad_bytes(plan, adapter) if plan.held else all_sharded,
            "held_grads": plan.held_grad_bytes(),
            "held_params": plan.held_param_bytes(),
            "activations": max(sim.activations - activations_less, 0),
            **({"resident_params": resident} if resident else {}),
            "generation_params": plan.generation_bytes,
            **({"generation_peak": phases["generation"]} if "generation" in phases else {}),
        }
        return StepPeak(peak_bytes=int(phases[phase]), phase=phase, parts=parts, unmodeled=unmodeled)

    def _schedule(self, plan: Plan, adapter: ModelAdapter, mode: str) -> Schedule | None:
        """`plan` as a `Schedule` by unit key; None where keys would merge layers it treats
        differently and the model is simulated with fewer layers."""
        held = {unit_key(u.name) for u in plan.held}
        windowed = {unit_key(u.name) for u in plan.windowed}
        resident = {unit_key(u.name) for u in adapter.units if u.resident}
        whole = self.layers is None or self.layers <= 2
        if not whole:
            for u in adapter.units:
                key = unit_key(u.name)
                if (key in held) != any(h is u for h in plan.held):
                    return None
                if (key in windowed) != any(w is u for w in plan.windowed):
                    return None
                if (key in resident) != u.resident:
                    return None
        else:
            held, windowed = {u.name for u in plan.held}, {u.name for u in plan.windowed}
            resident = {u.name for u in adapter.units if u.resident}
        sync = plan.held_sync if plan.held else GRADIENT_SYNC
        return Schedule(mode, frozenset(held), frozenset(windowed), sync, frozenset(resident))


def resident_beyond_window(plan: Plan, adapter: ModelAdapter) -> int:
    """Unsharded param bytes per rank of the frozen units `keep_frozen_unsharded` keeps for the run
    (`Unit.resident`) that `plan` does not window (a windowed one is in `held_param_bytes`)."""
    return sum(u.param_bytes for u in adapter.units if u.resident and not any(w is u for w in plan.windowed))


def _on(plan: Plan, adapter: ModelAdapter, other: ModelAdapter) -> Plan:
    """`plan` (over `adapter`'s units) over the same units of `other`, the same model read
    under another torch's dtype rules."""
    same = {id(u): o for u, o in zip(adapter.units, other.units, strict=True)}
    return dataclasses.replace(
        plan, held=[same[id(u)] for u in plan.held], windowed=[same[id(u)] for u in plan.windowed]
    )
