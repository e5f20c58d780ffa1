"""Configuration: `GradSyncConfig`, its one defaults table and its sources (explicit > environment
> default) in `settings`; how a source's text becomes a value (booleans, memory sizes) in `values`;
errors and warnings in `errors`. Imports nothing else from the package."""
