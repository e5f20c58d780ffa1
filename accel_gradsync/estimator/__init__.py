"""The estimate: a launch's units and per-mode costs from its accelerate config and model config,
on a meta model sharded over a fake process group, through the same planning code a live run uses.

Modules, each importing only those before it: `inputs` (the configs, read and checked) <
`fake_shard` (the libraries' sharding in a fake process group) < `meta_model` (the units a launch
would have) < `results` < `row_costs` < `step_peak` (the whole step's peak, on fake tensors) < `core`
(`estimate`: one row per mode) < `formatting` < `cli`; `reference`, `fake_step` beside them;
`forecast/`, `auto`'s step-1 forecast in a live run, over them all.
"""
