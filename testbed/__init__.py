"""What the multi-rank tests and the benchmarks run on: ranks launched as users launch them
(`launch.py`: `accelerate launch`, or torchrun for CPU DDP), simulated hosts joined by shaped links
(`cluster.py`) and the real collectives counted around `torch.distributed` (`collectives.py`).
It imports neither the tests nor the benchmarks: both stand on it."""
