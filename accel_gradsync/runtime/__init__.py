"""The runtime: reading a wrapped model (`adapt`: an `adapter` per wrapper, `fsdp2`, `fsdp1`,
`ddp`), binding it (`bind`), the hot path per micro-batch (`window`, `generation`), counters
(`accounting`), the decision line (`decision`), checkpoints and the hooks into Accelerate and the
Trainer (`hooks`, `callback`). Imports `planning`, `compat`, `config`."""
