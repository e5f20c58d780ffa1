"""What an accumulation window tells the user about how its `no_sync` was used: the refusal of a
`no_sync` entered outside `accumulate()` where the plan needs M, and the one-time warnings where
the window cannot do what its plan says (window.py calls each at the moment it finds out).
"""

from __future__ import annotations

from collections.abc import Sequence

from accel_gradsync.config.settings import SyncMode
from accel_gradsync.planning.units import ALL_REDUCE, Unit
from accel_gradsync.runtime.core.state import Attachment


def check_explicit_no_sync(state: Attachment) -> None:
    """A `no_sync` the user entered outside `accumulate()`: say once that `per_micro_batch`
    overrides it; refuse the modes that plan per unit for M micro-batches when M is unknown."""
    mode = state.policy.name
    if mode == SyncMode.PER_MICRO_BATCH:
        state.warn_once(
            "explicit_no_sync",
            "accel_gradsync: accelerator.no_sync(model) is overridden by sync mode 'per_micro_batch': every "
            "micro-batch reduce-scatters its gradients (sharded, lowest memory). Use sync mode 'deferred' "
            "(GradSyncConfig(defer=True), --defer-grad-sync) to hold them inside no_sync.",
        )
    elif mode in (SyncMode.BUDGET, SyncMode.AUTO) and state.micro_batches_per_step == 1:
        raise ValueError(
            f"accelerator.no_sync(model) holds gradients over several micro-batches, but sync mode '{mode}' "
            "plans each unit for the M micro-batches of one optimizer step and the Accelerator has "
            "gradient_accumulation_steps=1. Build it with Accelerator(gradient_accumulation_steps=M) (M-1 "
            "micro-batches inside no_sync, then the one that syncs), or use sync mode 'deferred'."
        )


def warn_cannot_hold_yet(state: Attachment, units: int) -> None:
    """`units` planned to hold sync this micro-batch (the adapter's `holdable`)."""
    state.warn_once(
        "fallback",
        f"accel_gradsync: {units} unit(s) sync this micro-batch instead of "
        "holding: torch's FSDP2 cannot hold a gradient that must be cast to reduce_dtype for a "
        "unit that has not run yet. They hold once they have run; gradients stay exact.",
    )


def warn_evened_out(state: Attachment) -> None:
    """The adapter gave zero gradients to parameters a held micro-batch left without one."""
    state.warn_once(
        "even_out",
        "accel_gradsync: some parameters got no gradient in a held micro-batch while others in "
        "their unit did; they now hold a zero gradient in the reduce dtype so that a later "
        "first gradient reduces correctly (torch's FSDP2 needs one dtype per unit).",
    )


def warn_if_sync_each_batch(state: Attachment) -> None:
    """A micro-batch that does not end the step ran outside `no_sync`: where the mode holds
    anything and accelerate's shared `sync_each_batch` was switched on after attach (by another
    Accelerator or Trainer in this process), say that the mode is not applied."""
    if state.policy.name == SyncMode.PER_MICRO_BATCH:
        return
    if state.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        state.warn_once(
            "sync_each_batch",
            f"accel_gradsync: sync mode '{state.policy.name}' is not applied: accelerate's "
            "sync_each_batch=True was set after attach() and makes every micro-batch sync.",
        )


def warn_if_clipped_mid_window(state: Attachment, held: Sequence[Unit], units: Sequence[Unit], hold: str) -> None:
    """`accelerator.clip_grad_norm_` inside a micro-batch that does not end the step, of a model
    whose plan holds `held` of its `units` (`hold`: what they skip): where the others reduced this
    micro-batch, the clip scales their partial sums alone, as no stock configuration does; under
    HSDP's `defer_all_reduce` it scales each replica group's partial sums by that group's norm."""
    if hold == ALL_REDUCE and held:
        state.warn_once(
            "clip_mid_window",
            "accel_gradsync: accelerator.clip_grad_norm_ ran in a micro-batch that does not end the optimizer "
            "step, under defer_all_reduce: the gradients are reduce-scattered but not yet all-reduced across "
            "replicas, so it scales each replica group's partial gradients by that group's own norm (no stock "
            "configuration does). Clip only when accelerator.sync_gradients is True.",
        )
        return
    synced = [u for u in units if not u.frozen and u not in held]
    if not held or not synced:
        return  # all held: nothing to clip yet, as under accelerate's no_sync; none: sync_each_batch's
    state.warn_once(
        "clip_mid_window",
        f"accel_gradsync: accelerator.clip_grad_norm_ ran in a micro-batch that does not end the optimizer "
        f"step, where the plan holds {len(held)} unit(s) and {len(synced)} reduce every micro-batch: it "
        "scales those units' partial gradients alone (accelerate's no_sync clips none of them before the step, "
        "sync_each_batch=True all of them). Clip only when accelerator.sync_gradients is True.",
    )
