"""The runtime: reading a wrapped model (`adapt`: an `adapter` per wrapper, `fsdp2` with the
private reads it shares in `fsdp2_state`, `fsdp2_grads` and `fsdp2_counts`; `fsdp1`, `ddp`),
binding it (`bind`) into what one `attach()` holds (`state`), the hot path per micro-batch
(`window`, what it tells the user in `window_checks`), generation (`generation`,
`quiet_generation`, `token_sync`), uneven inputs (`join`, with
`join_poll`, `join_watch`, `join_record`, `join_steps`; `uneven`; per-rank counts every step:
`uneven_steps`), the plugin's own collectives
(`agreement`), counters (`accounting`),
the decision line (`decision`), checkpoints (`checkpoint`, `plan_checkpoint`, `resume`), the
hooks into Accelerate and the Trainer (`connection`, `hooks`, `callback`, `preemption`) and
`handle`, the user's `GradSyncHandle`. Imports `planning`, `compat`, `config`."""
