"""Which reduce dtype a sync mode asks for: a planning rule (the modes that choose what to hold),
read where attach writes the FSDP plugin's policy (planning/costs.py `reduce_dtype_policy`), by the
decision line and by the estimate's rows."""

from __future__ import annotations

from accel_gradsync.config.settings import SyncMode

FP32_HELD_MODES = (SyncMode.AUTO.value, SyncMode.BUDGET.value)
"""The sync modes whose `reduce_dtype` `auto` means fp32. FSDP2 holds deferred gradients in the
reduce dtype, so with a bf16 reduce M micro-batches are summed in bf16, where per-micro-batch
sync sums each one's reduced shard in fp32 (measured in docs/modes.md). These modes choose what to
hold themselves, so they hold in fp32 unless `reduce_dtype` says bf16; the others keep
accelerate's choice, the param dtype."""


def reduce_dtype_for(sync_mode: str, reduce_dtype: str) -> str:
    """The reduce dtype a sync mode asks for: `reduce_dtype` itself, except that `auto` is fp32
    in `FP32_HELD_MODES` (else `auto`: accelerate's choice stays). `costs.reduce_dtype_policy`
    writes fp32 only where the model computes in less (bf16 mixed precision)."""
    return "fp32" if reduce_dtype == "auto" and sync_mode in FP32_HELD_MODES else reduce_dtype
