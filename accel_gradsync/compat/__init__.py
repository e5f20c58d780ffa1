"""Shims for what torch, accelerate and transformers do wrong or not yet, and what differs between
the releases setup.cfg allows (each module says what and why): FSDP on CPU (`cpu`), exit-time
teardown (`teardown`), FSDP1's sharded optimizer reload (`optimizer_state`), where each torch
series keeps FSDP2's private state and how it holds deferred gradients (`fsdp2`, `fsdp2_grads`),
the tested torch series (`versions`) and the transformers renames (`releases`). Imports only
`config`."""
