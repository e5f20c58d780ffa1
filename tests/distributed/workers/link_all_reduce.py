"""One 8 MiB gloo all-reduce under torchrun with no accelerate config: the process group DDP's launch
gets, for the simulated cluster's multi-node torchrun (test_cluster.py)."""

import torch
import torch.distributed as dist
from common import parse_args, write_result

args = parse_args()
dist.init_process_group("gloo")
x = torch.ones(2**21)  # 8 MiB of fp32
dist.all_reduce(x)
write_result(args.out, {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(x[0])})
