"""Sync policies: which FSDP units hold their gradients on a micro-batch that is not the last.

One subclass per strategy, as torchtitan does for its activation-checkpointing modes. A policy
only decides; `fsdp.py` applies the decision and `integration.py` calls both. The final
micro-batch of every optimizer step always syncs every unit, whatever the policy says.
"""

from __future__ import annotations

from typing import Sequence

from .config import GradSyncConfig
from .fsdp import Unit


class SyncPolicy:
    """Base class: the units whose reduce-scatter is skipped on a non-final micro-batch."""

    name: str = ""
    description: str = ""

    def deferred_units(self, units: Sequence[Unit]) -> list[Unit]:
        raise NotImplementedError


class PerMicroBatchSync(SyncPolicy):
    """Reduce-scatter every unit after every micro-batch: M x U collectives per optimizer step,
    gradients stay sharded (about P/N x 4 bytes per rank). FSDP2: `requires_gradient_sync`
    stays True; FSDP1/DDP: no `no_sync()`."""

    name = "per_micro_batch"
    description = "reduce-scatter after every micro-batch (sharded grads, lowest memory)"

    def deferred_units(self, units: Sequence[Unit]) -> list[Unit]:
        return []


class DeferredSync(SyncPolicy):
    """Skip every unit's reduce-scatter until the last micro-batch: U collectives per optimizer
    step, but each rank holds the whole unsharded gradient (P x sizeof(retained dtype)) between
    micro-batches. FSDP2: `set_requires_gradient_sync(False)`; FSDP1/DDP: root `no_sync()`."""

    name = "deferred"
    description = "reduce-scatter once per optimizer step (unsharded grads held)"

    def deferred_units(self, units: Sequence[Unit]) -> list[Unit]:
        return list(units)


POLICIES: dict[str, type[SyncPolicy]] = {
    PerMicroBatchSync.name: PerMicroBatchSync,
    DeferredSync.name: DeferredSync,
}


def resolve_policy(config: GradSyncConfig) -> SyncPolicy:
    """The policy a config selects."""
    try:
        return POLICIES[config.mode]()
    except KeyError:
        raise ValueError(
            f"GradSyncConfig selects sync mode {config.mode!r}; valid choices: {', '.join(POLICIES)}."
        ) from None
