"""Side-by-side benchmarks of every gradient-sync mode against the loops a user would otherwise
write: `python -m benchmarks.run` (run.py, the one harness), its MLP and GRPO benchmarks as
configurations of it. See docs/performance.md."""
