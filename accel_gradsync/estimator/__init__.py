"""The estimate: a launch's units and per-mode costs from its accelerate config and model config,
on a meta model sharded over a fake process group, through the same planning code a live run uses.
The CLI (`accel-gradsync estimate`) is `cli`."""
