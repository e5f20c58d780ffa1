"""GRPO's reference model (TRL's `beta` > 0) in the estimate: built on the meta device as the trained
model is, frozen, sharded by TRL's own `prepare_fsdp` (fake_shard.py: one FSDP2 unit at the root) and
read by the runtime's adapter, so its units, the header's line (`decision.describe_frozen`), whether
it keeps them (`decision.frozen_keeps`) and whether it stays resident (`residency.decide_residency`,
for each row's sync mode: `count_for_mode`; the header's for the selected one) come from the code a
live run binds it with. Counts assume
TRL's default `steps_per_generation` = M: one log-prob pass of M forwards per optimizer step. Under
LoRA there is no second model; FSDP1 and transformers-sharded launches are said, not estimated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from accel_gradsync.config.settings import GradSyncConfig, ResolvedConfig
from accel_gradsync.estimator.fake_shard import fake_world, shard_like_trl
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec
from accel_gradsync.estimator.meta_model import build_accelerate_plugin, build_meta_model
from accel_gradsync.estimator.results import ReferenceEstimate
from accel_gradsync.estimator.step_peak import StepPeak
from accel_gradsync.planning.costs import generation_all_gathers
from accel_gradsync.planning.residency import Residency, decide_residency, kept_bytes
from accel_gradsync.runtime.core.decision import describe_frozen, frozen_keeps
from accel_gradsync.runtime.wrappers.adapt import adapt_model, model_name
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter, dim0_shard_numel

NAME = "ref_model"
"""The Trainer attribute TRL keeps it in, which a live run names it by."""
LORA_LINE = (
    "grad sync: reference model: none under LoRA: TRL's reference pass is the policy with its adapter "
    "disabled, so its all-gathers are the trained units' own (0 more where they are windowed, kept through the "
    "window; other modes gather the units again per forward, counted as generation's)"
)
PASS_UNMODELED = (
    "the reference pass's activations (its log-prob forward of one micro-batch: only its params are in the "
    "reference_pass phase)"
)


def check_beta(beta: float) -> None:
    """`--beta`, GRPO's KL coefficient: 0 (TRL's default, no reference model) or positive."""
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(
            f"--beta={beta}: GRPO's KL coefficient is 0 (TRL's default: no reference model) or positive; "
            "pass the run's GRPOConfig beta, e.g. 0.04, or leave --beta out."
        )


def estimate_reference(
    beta: float,
    model_config: Any,
    model_dtype: torch.dtype,
    setup: FSDPSetup,
    config: GradSyncConfig,
    micro_batches: int,
    lora: LoraSpec | None = None,
) -> ReferenceEstimate | None:
    """The reference model a GRPO run with `beta` has beside the trained one, counted for the
    selected sync mode; None for beta 0."""
    reference = build_reference(beta, model_config, model_dtype, setup, config, lora)
    return count_for_mode(reference, config, micro_batches)


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
    """The reference model sharded as TRL shards it, read by the runtime's adapter: built once per
    estimate, counted for each row's sync mode (`count_for_mode`)."""

    beta: float
    adapter: ModelAdapter
    name: str
    num_processes: int
    sharded_bytes: int
    """Its sharded params per rank."""


def build_reference(
    beta: float,
    model_config: Any,
    model_dtype: torch.dtype,
    setup: FSDPSetup,
    config: GradSyncConfig,
    lora: LoraSpec | None = None,
) -> ReferenceModel | ReferenceEstimate | None:
    """The reference model of a GRPO run with `beta`: None for beta 0; a `ReferenceEstimate` that
    says why where there is nothing to count (LoRA: no second model; FSDP1 and transformers-sharded
    launches: not estimated); else the sharded model to count."""
    check_beta(beta)
    if beta == 0:
        return None
    if lora is not None:
        return ReferenceEstimate(beta, LORA_LINE, policy_adapter_off=True)
    if setup.distributed_config:
        why = (
            "a model transformers shards at load time; TRL shards its reference model with accelerate's FSDP "
            "plugin (prepare_fsdp): estimate with --accelerate-config for that launch"
        )
        return ReferenceEstimate(beta, f"grad sync: reference model: not estimated for {why}", estimated=False)
    if setup.fsdp_version != 2:
        why = (
            "TRL shards it with FSDP1, which the plugin does not bind: it gathers as stock FSDP1 does, in each "
            "forward of its log-prob pass"
        )
        return ReferenceEstimate(beta, f"grad sync: reference model: not estimated: {why}", estimated=False)
    model = build_meta_model(model_config, model_dtype)
    model.requires_grad_(False)
    plugin = build_accelerate_plugin(setup, config, model)
    with fake_world(setup.num_processes):
        wrapped = shard_like_trl(model, plugin, setup.mixed_precision, setup.replicate_size, setup.shard_size)
        adapter = adapt_model(wrapped)
        assert adapter is not None  # fully_shard wrapped the root
        sharded = sum(dim0_shard_numel(p.shape, setup.shard_size) * p.element_size() for p in wrapped.parameters())
    return ReferenceModel(beta, adapter, model_name(wrapped), setup.num_processes, sharded)


def count_for_mode(
    reference: ReferenceModel | ReferenceEstimate | None,
    config: GradSyncConfig,
    micro_batches: int,
    sync_mode: str | None = None,
) -> ReferenceEstimate | None:
    """`reference` counted over a step of M micro-batches under `sync_mode` (default: the one
    `config` selects), which decides its residency; one with nothing to count as it is."""
    if not isinstance(reference, ReferenceModel):
        return reference
    settings = config.resolved()
    if sync_mode is not None:
        settings = dataclasses.replace(settings, sync_mode=sync_mode)
    return count_reference(reference, settings, config.free_memory_bytes, micro_batches)


def count_reference(
    reference: ReferenceModel, settings: ResolvedConfig, free: int | None, micro_batches: int
) -> ReferenceEstimate:
    """The counts of the sharded reference model over a step of M micro-batches under `settings`
    (`free`: free memory per rank, where given): its log-prob pass is one forward per micro-batch,
    kept or not, resident or not, as binding decides."""
    adapter = reference.adapter
    units = adapter.units
    sizes = [u.param_bytes for u in units]
    try:
        residency = decide_residency(settings, sum(sizes), lambda: _free_memory(free))
    except _NoFreeMemory:
        residency = Residency(
            False,
            f"sync mode {settings.sync_mode} decides it at launch from free memory per rank: "
            "--grad-sync-free-memory shows that decision here",
        )
    keeps = residency.resident or frozen_keeps(units, settings.gather_for_generation)
    # Resident: its first forward gathers each unit once, no step after step 1 gathers it.
    gathers = [0 if residency.resident else generation_all_gathers([u], micro_batches, kept=keeps) for u in units]
    stock = generation_all_gathers(units, micro_batches, kept=False)
    sent = sum(n * u.param_bytes * (u.shard_size - 1) / u.shard_size for n, u in zip(gathers, units, strict=True))
    one = reference.num_processes == 1  # FSDP2 issues no collective over one rank
    return ReferenceEstimate(
        reference.beta,
        describe_frozen(NAME, reference.name, adapter, keeps, residency),
        units=len(units),
        keeps=keeps,
        resident=residency.resident,
        all_gathers_per_step=0 if one else sum(gathers),
        first_step_all_gathers=0 if one else generation_all_gathers(units, 1, kept=True) if residency.resident else 0,
        stock_all_gathers_per_step=0 if one else stock,
        sharded_param_bytes=reference.sharded_bytes,
        unsharded_param_bytes=sum(sizes) if keeps else max(sizes),
        reserved_bytes=kept_bytes(units, keeps, residency.resident),
        send_bytes_per_step=0 if one else int(sent),
    )


class _NoFreeMemory(Exception):
    """The residency decision reads free memory, and the estimate was given none."""


def _free_memory(free: int | None) -> int:
    """`--grad-sync-free-memory`, which auto's and a fractional budget's residency decision reads."""
    if free is None:
        raise _NoFreeMemory
    return free


def add_reference(peak: StepPeak, reference: ReferenceEstimate | None, policy_kept: int = 0) -> StepPeak:
    """A row's step peak with the reference model in it: its sharded params resident in every
    phase (`reference_params`), and its log-prob pass as a phase of its own (`reference_pass`:
    the trained model's sharded params and optimizer state, `policy_kept` (the trained model's
    params the row's plan keeps unsharded from generation on: its windowed units, or
    `gather_for_generation`), the reference's sharded params and what the pass holds unsharded;
    no gradients live between steps). The pass's activations are not simulated: `unmodeled` says so."""
    if reference is None or not reference.sharded_param_bytes:
        return peak
    # Resident for the run (`keep_reference_unsharded`): its unsharded params beside the sharded ones in every phase.
    resident = reference.sharded_param_bytes + (reference.unsharded_param_bytes if reference.resident else 0)
    parts = {**peak.parts, "reference_params": resident}
    if "generation_peak" in parts:
        parts["generation_peak"] += resident
    parts["reference_pass"] = (
        parts.get("sharded_params", 0)
        + parts.get("optimizer_state", 0)
        + policy_kept
        + resident
        + (0 if reference.resident else reference.unsharded_param_bytes)
    )
    peak_bytes, phase = peak.peak_bytes + resident, peak.phase
    if parts["reference_pass"] > peak_bytes:
        peak_bytes, phase = parts["reference_pass"], "reference_pass"
    return dataclasses.replace(
        peak, peak_bytes=peak_bytes, phase=phase, parts=parts, unmodeled=[*peak.unmodeled, PASS_UNMODELED]
    )
