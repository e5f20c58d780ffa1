"""Configuration: `GradSyncConfig`, its one defaults table and its sources (explicit > environment
> default). Imports nothing else from the package."""
