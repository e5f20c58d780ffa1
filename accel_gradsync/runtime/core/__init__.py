"""What one `attach()` holds and counts: `state` (`Attachment`, `BoundModel`, `FrozenModel`),
`accounting` (the live counters), `fsdp2_counts` (FSDP2's collectives counted as it issues
them), `agreement` (the plugin's own gloo group, `RankMemory`) and `decision` (the decision line
and the plan's warnings). Imports `wrappers`."""
