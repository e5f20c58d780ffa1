"""Side-by-side benchmarks of every gradient-sync mode against the peers a user would pick
(stock accelerate, the transformers Trainer, a hand-written FSDP2 loop). Entry point:
`python -m benchmarks.run`; see README.md, "Benchmarks"."""
