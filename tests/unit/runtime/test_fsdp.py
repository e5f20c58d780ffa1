"""The FSDP2 private attributes the adapter reads are checked at bind, with a message that names
the torch version: real `fully_shard` on a 1-rank gloo group (no mock), with one attribute hidden
the way a torch release that renamed it would."""

import re
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from accel_gradsync.compat.teardown import install_exit_guard
from accel_gradsync.runtime.fsdp import FSDP2Adapter, check_fsdp2_internals


@pytest.fixture(scope="module")
def model():
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


@pytest.mark.compat
def test_this_torch_has_what_the_adapter_reads(model):
    check_fsdp2_internals(model)
    assert len(FSDP2Adapter(model).units) == 2


def test_a_renamed_attribute_is_named_with_the_torch_version(model, monkeypatch):
    group = model._get_fsdp_state()._fsdp_param_groups[0]  # the first unit checked: the root
    monkeypatch.delattr(type(group), "post_forward_mesh_info", raising=False)
    monkeypatch.delattr(group, "post_forward_mesh_info", raising=False)
    with pytest.raises(
        RuntimeError, match=rf"post_forward_mesh_info.*torch {re.escape(torch.__version__)}.*tested: torch 2.13 or 2.14"
    ):
        check_fsdp2_internals(model)
