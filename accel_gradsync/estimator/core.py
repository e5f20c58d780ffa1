"""What each sync mode would cost, before launch: `estimate` plans every mode of `policies.POLICIES`
(and deferral with every unit windowed) with the very policies a live run uses, over the units a
launched run would have (meta_model.py), and fills one row per mode from each plan: counts from
`planning.costs`, the other bytes from row_costs.py. A mode that cannot plan for this launch is a
row saying why (`applicable=False`); an input a launch would fail on raises instead.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

from accel_gradsync.compat.fsdp2 import release, torch_series
from accel_gradsync.compat.versions import TESTED_TORCH
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import GradSyncConfig, SyncMode, dtype_name
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec, StepShape, load_model_config, read_launch_setup
from accel_gradsync.estimator.meta_model import NeedsFreeMemory, build_meta_model, estimated_adapter, keep_frozen_for
from accel_gradsync.estimator.reference import (
    ReferenceModel,
    add_reference,
    build_reference,
    check_beta,
    count_for_mode,
)
from accel_gradsync.estimator.results import Estimate, ModeEstimate, ReferenceEstimate
from accel_gradsync.estimator.row_costs import (
    count_held_bytes_in_compute_dtype,
    count_peak_grad_bytes,
    count_sent_bytes,
    count_sharded_grad_bytes,
)
from accel_gradsync.estimator.step_peak import StepForecaster, resident_beyond_window
from accel_gradsync.planning.costs import all_gathers_per_step, collectives_per_step, generation_cost
from accel_gradsync.planning.policies import POLICIES, DeferredSync, SyncPolicy
from accel_gradsync.planning.reduce_dtype import reduce_dtype_for
from accel_gradsync.planning.residency import frozen_residency_under_vllm, windows_every_unit
from accel_gradsync.planning.units import ALL_REDUCE, Plan
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter

WINDOWED_ROW = "deferred+windowed"
"""The row for deferral with every unit windowed (`keep_params_unsharded`), shown whatever is selected."""
ONE_PROCESS = (
    "one process: nothing to sync between ranks (FSDP sends nothing over one rank), so attach does nothing "
    "and every mode runs the same"
)
_ROWS: list[tuple[str, type[SyncPolicy]]] = [*POLICIES.items(), (WINDOWED_ROW, DeferredSync)]


def estimate(
    model_spec: str | dict,
    accelerate_config: str | os.PathLike | dict | None,
    micro_batches: int,
    config: GradSyncConfig | None = None,
    num_processes: int | None = None,
    model_dtype: torch.dtype = torch.float32,
    mixed_precision: str | None = None,
    distributed_config: str | os.PathLike | dict | None = None,
    step_shape: StepShape | None = None,
    lora: LoraSpec | None = None,
    beta: float = 0.0,
    torch_release: str | None = None,
    use_vllm: bool = False,
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
        step_shape (`StepShape`, *optional*): the micro-batch and optimizer; with it every row
            also gets the whole step's peak per rank (`step_peak_bytes`, step_peak.py).
        lora (`LoraSpec`, *optional*): a LoRA fine-tune (PEFT): only its adapters are trainable.
        beta (`float`): GRPO's KL coefficient; above 0 TRL keeps a reference model, estimated
            apart (`Estimate.reference`, reference.py, for the selected mode) and in every row's
            step peak, resident or not as that row's mode decides.
        torch_release (`str`, *optional*): the torch series the cluster runs ("2.13", "2.14",
            "2.15"), whose FSDP2 dtype rules the rows follow (2.15 holds and reduces gradients in
            the parameter's dtype where the policy sets no reduce dtype; 2.14 in the compute
            dtype). Default: this process's torch. The model is still sharded, and the step peak
            simulated, by this process's torch: a step peak for another release says so.
        use_vllm (`bool`): GRPO with TRL's `use_vllm`: vLLM generates, so the step peak has no
            generation phase, and `keep_frozen_unsharded` keeps nothing (true is refused), as
            attach decides for such a Trainer (`planning.residency.frozen_residency_under_vllm`).

    Returns:
        `Estimate`: the model, mesh and units, and one `ModeEstimate` per mode of
        `policies.POLICIES` plus the `deferred+windowed` row.

    Raises:
        `ValueError`: an input a launch would also fail on, named with what to change (both or
            neither of the two configs, a config accelerate cannot shard, M below 1, a process
            that already has a torch.distributed group, a negative beta), or a launch the estimate
            does not model (`lora` on a model transformers shards: the adapter trains outside FSDP),
            a `torch_release` that is not a tested series, `keep_frozen_unsharded` true with
            `use_vllm`.
    """
    check_beta(beta)
    series = check_torch_release(torch_release)
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: needs at least 1 micro-batch per optimizer step.")
    config = GradSyncConfig() if config is None else config
    spelled = config.keep_frozen_unsharded
    if use_vllm:  # true refused, auto keeps nothing: what attach decides for a TRL trainer with use_vllm
        frozen_residency_under_vllm(config.resolved())
        config = dataclasses.replace(config, keep_frozen_unsharded="false")
    setup = read_launch_setup(accelerate_config, distributed_config, num_processes, mixed_precision)
    if lora is not None and setup.distributed_config:
        raise ValueError(
            f"--lora-r={lora.r} with --distributed-config: PEFT adds the adapter after transformers sharded the "
            "model, so its weights are plain tensors outside every FSDP unit (the Trainer all-reduces them) and "
            "no unit trains: nothing to plan, and the estimate does not model that launch. Drop --lora-r for the "
            "base model's units, or estimate a LoRA model accelerate shards with --accelerate-config."
        )
    adapters = _AdaptersByReduceDtype(load_model_config(model_spec), model_dtype, setup, config, lora, series)
    try:
        header = adapters.for_mode(config.mode)
    except ValueError:  # its keep_frozen_unsharded reads free memory, not given: the row says so
        header = adapters.for_mode(config.mode, keep=False)
    result = _describe_launch(model_spec, setup, config, header, micro_batches)
    result.torch, result.torch_running, result.use_vllm = series, torch.__version__, use_vllm
    if lora is not None:  # frozen units to keep: each row says which it keeps
        result.keep_frozen_unsharded = spelled  # as spelled: auto, true or false
    reference_model = build_reference(beta, adapters.model_config, model_dtype, setup, config, lora)
    result.reference = count_for_mode(reference_model, config, micro_batches)
    sim = None
    if step_shape is not None:
        sim = StepForecaster(
            adapters.model_config, model_dtype, setup, config, step_shape, micro_batches, lora, use_vllm
        )
        result.step_shape = dataclasses.asdict(step_shape)
    result.modes = [
        _estimate_row(name, policy, config, adapters, setup, micro_batches, sim, reference_model)
        for name, policy in _ROWS
    ]
    return result


class _AdaptersByReduceDtype:
    """The sharded model per reduce dtype the rows need, each sharded once: auto and budget hold
    fp32 where the others keep accelerate's reduce dtype (`planning.reduce_dtype.reduce_dtype_for`), as attach
    writes it per mode. Nothing reaches a model transformers shards, and without mixed precision
    there is nothing to widen: one adapter serves every row."""

    def __init__(
        self,
        model_config: Any,
        model_dtype: torch.dtype,
        setup: FSDPSetup,
        config: GradSyncConfig,
        lora: LoraSpec | None = None,
        torch_release: str | None = None,
    ):
        self.model_config, self.model_dtype, self.setup, self.config = model_config, model_dtype, setup, config
        self.lora = lora
        self.torch_release = torch_release
        self.chosen = config.resolved().reduce_dtype
        self.same = bool(setup.distributed_config) or setup.mixed_precision == "no"
        self.adapters: dict[tuple[str, str | None, str | None], ModelAdapter] = {}

    def for_mode(
        self, mode: str, running: bool = False, keep: bool = True, keep_params: bool | None = None
    ) -> ModelAdapter:
        """Mode `mode`'s sharded model, its units following the estimate's torch release, or with
        `running` this process's torch (what the step simulation holds); a LoRA model split and its
        frozen units kept as `keep_frozen_unsharded` does under `mode` (`keep_frozen_for`; `keep_params`,
        where given, for `keep_params_unsharded`), unless not `keep`. A mode whose keeping reads
        free memory, with none given, raises the `ValueError` its row shows."""
        dtype = self.chosen if self.same else reduce_dtype_for(mode, self.chosen)
        # A LoRA model's frozen units, kept as a live prepare keeps them under `mode`. Only a LoRA
        # model has any (no reference model beside it: nothing resident to take room first).
        frozen = keep_frozen_for(self.setup, self.config, mode, self.config.free_memory_bytes, keep_params=keep_params)
        frozen = frozen if keep and self.lora is not None else None
        # The same decision for every mode where the setting is true: one model serves them all.
        kept = None
        if frozen is not None:
            windowed = windows_every_unit(frozen.settings)
            kept = "all" if frozen.settings.keep_frozen_unsharded is True else WINDOWED_ROW if windowed else mode
        key = (dtype, None if running else self.torch_release, kept)
        if key not in self.adapters:
            model = build_meta_model(self.model_config, self.model_dtype, self.lora)
            try:
                self.adapters[key] = estimated_adapter(model, self.setup, self.config, mode, key[1], frozen)
            except NeedsFreeMemory as err:
                raise ValueError(str(err)) from None
        return self.adapters[key]


def _describe_launch(
    model_spec: str | dict, setup: FSDPSetup, config: GradSyncConfig, adapter: ModelAdapter, micro_batches: int
) -> Estimate:
    """The estimate's header, without rows: the model, wrapper, mesh, dtypes and units."""
    return Estimate(
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
        free_memory=config.free_memory_bytes,
        sharded_by="transformers" if setup.distributed_config else "accelerate",
        compute_dtype=dtype_name(adapter.units[0].compute_dtype),  # every unit computes in it
    )


def _estimate_row(
    name: str,
    policy_cls: type[SyncPolicy],
    config: GradSyncConfig,
    adapters: _AdaptersByReduceDtype,
    setup: FSDPSetup,
    micro_batches: int,
    sim: StepForecaster | None = None,
    reference_model: ReferenceModel | ReferenceEstimate | None = None,
) -> ModeEstimate:
    """Row `name`: the plan `policy_cls` makes for this launch, or why it makes none; with `sim`
    also its whole-step peak, the reference model's bytes in it (`reference_model` counted for
    this row's mode, which decides whether it is resident)."""
    windowed = config.sync_mode == SyncMode.DEFERRED and config.keep_params_unsharded
    selected = name == (WINDOWED_ROW if windowed else config.sync_mode)
    try:
        # The deferred rows show deferral without and with every unit windowed, whatever the config says.
        keep_params = {SyncMode.DEFERRED: False, WINDOWED_ROW: True}.get(name)
        if policy_cls.name == SyncMode.BUDGET and not config.memory_budget:
            raise ValueError("needs a budget: set --grad-sync-memory-budget (e.g. 12GiB or 0.5 of free memory).")
        adapter = adapters.for_mode(policy_cls.name, keep_params=keep_params)
        reference = count_for_mode(reference_model, config, micro_batches, policy_cls.name)
        # Within memory less what the reference model and the kept frozen units keep, as a live
        # run plans (budget, auto: bind.py's `_plan`).
        reserved = reference.reserved_bytes if reference is not None else 0
        reserved += sum(u.param_bytes for u in adapter.units if u.resident)
        plan = _plan_mode(policy_cls, config, adapter, config.free_memory_bytes, micro_batches, keep_params, reserved)
        plan = plan.over(micro_batches)
        if setup.num_processes == 1:
            plan = Plan(policy_cls.name, reason=ONE_PROCESS)
    except ValueError as err:
        return ModeEstimate(name, applicable=False, reason=str(err), selected=selected)
    label = _label_plan(plan)
    mode = name if label == name or name == WINDOWED_ROW else f"{name} -> {label}"
    row = _count_row(mode, plan, adapter, setup, micro_batches)
    row.selected = selected
    if reference is not None and reference.estimated and not reference.policy_adapter_off:
        row.reference_resident, row.reference_all_gathers = reference.resident, reference.all_gathers_per_step
    row.fits = _check_fits(row, config)
    if sim is not None:
        # Windowed units (or gather_for_generation) keep the trained params from generation through the
        # pass, and keep_frozen_unsharded its kept units through every phase.
        kept = max(plan.held_param_bytes() + resident_beyond_window(plan, adapter), plan.generation_bytes)
        other = adapters.torch_release != torch_series()  # the cluster runs another torch than this process
        running = adapters.for_mode(policy_cls.name, running=True, keep_params=keep_params) if other else None
        peak = add_reference(sim.row(plan, adapter, policy_cls.name, running), reference, kept)
        row.step_peak_bytes, row.step_peak_phase = peak.peak_bytes, peak.phase
        row.step_peak_parts, row.step_peak_unmodeled = peak.parts, peak.unmodeled
    return row


def _count_row(mode: str, plan: Plan, adapter: ModelAdapter, setup: FSDPSetup, micro_batches: int) -> ModeEstimate:
    """Row `mode`'s counts and bytes per optimizer step for `plan`."""
    rs, ar = collectives_per_step(plan, adapter.units, adapter.hsdp, micro_batches)
    all_gathers, all_gather_bytes = all_gathers_per_step(plan, adapter, micro_batches)
    generation = generation_cost(plan, adapter.units)
    generation_all_gathers = generation.first if generation.kept else generation.per_token
    first, in_window = generation.first, generation.per_token_in_window
    if setup.num_processes == 1:  # FSDP2 issues no collective over one rank, FSDP1 sends nothing
        rs = ar = all_gathers = generation_all_gathers = first = 0
        in_window = None
    held_dtype = dtype_name(plan.held[0].held_dtype) if plan.held else ""
    resident = [u for u in adapter.units if u.resident]  # keep_frozen_unsharded's, as stats() counts them
    return ModeEstimate(
        mode=mode,
        reason=plan.reason,
        units_held=len(plan.held),
        reduce_scatters=rs,
        all_reduces=ar,
        send_bytes=count_sent_bytes(plan, adapter, micro_batches, setup.replicate_size),
        held_bytes=plan.held_grad_bytes(),
        held_dtype=held_dtype + (" (sharded)" if plan.held_sync == ALL_REDUCE else ""),
        held_bytes_compute_dtype=count_held_bytes_in_compute_dtype(plan),
        held_param_bytes=plan.held_param_bytes(),
        sharded_bytes=count_sharded_grad_bytes(plan, adapter),
        peak_bytes=count_peak_grad_bytes(plan, adapter),
        all_gathers=all_gathers,
        all_gather_bytes=all_gather_bytes,
        generation_bytes=plan.generation_bytes,
        generation_all_gathers=generation_all_gathers,
        generation_first_all_gathers=first,
        generation_all_gathers_in_window=in_window,
        units_resident=len(resident),
        resident_param_bytes=sum(u.param_bytes for u in resident),
        resident_units=[u.name or "<root>" for u in resident],
        resident_dtype=dtype_name(resident[0].compute_dtype) if resident else "",
        # Step 1 also gathers each kept unit once, at its first forward; no step after it does.
        first_step_all_gathers=all_gathers + (len(resident) if setup.num_processes > 1 else 0),
    )


def check_torch_release(torch_release: str | None) -> str:
    """The torch series the estimate plans for: `torch_release` when it is a tested one (raises
    otherwise, naming the choices), else this process's torch's (the newest tested one where
    this torch is of no tested series: its rules are the ones a run of it would be planned by)."""
    if torch_release is None:
        return release().series
    if torch_release not in TESTED_TORCH:
        raise ValueError(
            f"--torch={torch_release}: not a torch release series accel_gradsync is tested on; give the series the "
            f"cluster runs, one of {', '.join(TESTED_TORCH)}, or leave --torch out for this process's torch "
            f"({torch.__version__})."
        )
    return torch_release


def _check_fits(row: ModeEstimate, config: GradSyncConfig) -> bool | None:
    """Whether the row's worst moment, beside the frozen units kept for the run, fits free memory
    less the margin; None without free memory."""
    free = config.free_memory_bytes
    if free is None:
        return None
    # Generation's gathered params include the kept units' already.
    worst = max(row.peak_bytes + row.resident_param_bytes, row.generation_bytes + row.held_bytes)
    return worst <= int(free * (1 - config.resolved().memory_margin))


def _plan_mode(
    policy_cls: type[SyncPolicy],
    config: GradSyncConfig,
    adapter: ModelAdapter,
    free: int | None,
    micro_batches: int,
    keep_params: bool | None = None,
    reserved: int = 0,
) -> Plan:
    """`policy_cls`'s plan, as a live run makes it; `keep_params` overrides `keep_params_unsharded`;
    `reserved`: what a reference model keeps (`SyncPolicy.plan`). A mode that cannot plan here
    raises the `ValueError` its row shows."""
    if keep_params and adapter.kind != "fsdp2":
        raise ValueError("keeps FSDP2 units' params unsharded through the window; FSDP1's equivalent is SHARD_GRAD_OP.")
    if keep_params is not None:
        with warnings.catch_warnings():
            # The deferred rows set it whatever mode is selected: "ignored in sync mode X" is no news here.
            warnings.simplefilter("ignore", GradSyncWarning)
            config = dataclasses.replace(config, keep_params_unsharded=keep_params)

    def free_memory() -> int:
        if free is None:
            raise ValueError(f"{policy_cls.name} needs free memory per rank: set --grad-sync-free-memory (e.g. 40GiB).")
        return free

    return policy_cls(config.resolved()).plan(adapter, free_memory, micro_batches, reserved)


def _label_plan(plan: Plan) -> str:
    """What a row's plan amounts to: its mode, with the windows a deferral keeps said."""
    if plan.mode != SyncMode.DEFERRED or not plan.windowed:
        return plan.mode
    return WINDOWED_ROW if len(plan.windowed) == len(plan.held) else f"deferred ({len(plan.windowed)} windowed)"
