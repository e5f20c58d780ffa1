"""What the runtime reads of a wrapped model and does to it, one module per wrapper: `adapter`
(`ModelAdapter`, the `Wrapped` planning reads), `adapt` (which adapter, the wrapper checks,
`model_name`), `fsdp2` with the private FSDP2 reads it shares in `fsdp2_state` and `fsdp2_grads`,
`fsdp1`, `ddp`; `quiet_generation` (FSDP2's idle per-forward work skipped on kept units) and
`frozen_units` (`keep_frozen_unsharded`: adapters split into units of their own, the frozen ones
kept). Imports nothing of the runtime above it."""
