"""Fixtures the unit tests of several layers share."""

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from accel_gradsync.compat.teardown import install_exit_guard


@pytest.fixture(scope="module")
def fsdp2_model():
    """A real two-unit `fully_shard` model on a 1-rank gloo group (no mock)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    install_exit_guard()  # a gloo group in the test process: let its threads finish at exit
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(net[0])
    fully_shard(net)
    yield net
    dist.destroy_process_group()
