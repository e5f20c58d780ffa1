"""The FSDP2 private attributes the adapter reads are checked at bind, with a message that names
the torch version: real `fully_shard` on a 1-rank gloo group (no mock), with one attribute hidden
the way a torch release that renamed it would. And what the live counters predict a post-backward
reduces, where the torch releases differ (an HSDP partial sum held across a skipped unit)."""

import re

import pytest
import torch

from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.wrappers.fsdp2_state import check_fsdp2_internals


@pytest.mark.compat
def test_this_torch_has_what_the_adapter_reads(fsdp2_model):
    check_fsdp2_internals(fsdp2_model)
    assert len(FSDP2Adapter(fsdp2_model).units) == 2


def test_a_renamed_attribute_is_named_with_the_torch_version(fsdp2_model, monkeypatch):
    group = fsdp2_model._get_fsdp_state()._fsdp_param_groups[0]  # the first unit checked: the root
    monkeypatch.delattr(type(group), "post_forward_mesh_info", raising=False)
    monkeypatch.delattr(group, "post_forward_mesh_info", raising=False)
    with pytest.raises(
        RuntimeError,
        match=rf"post_forward_mesh_info.*torch {re.escape(torch.__version__)}.*tested: torch 2.13, 2.14 or 2.15",
    ):
        check_fsdp2_internals(fsdp2_model)


class _Skippable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, skip_first=False):
        return self.head(x if skip_first else self.first(x)).sum()


@pytest.mark.compat
def test_a_held_partial_sum_is_reduced_where_the_release_reduces_it(fsdp2_model):
    """HSDP with the all-reduce held, a unit that ran in the held micro-batch and not in the last:
    torch 2.15 reduces its held partial sum at the end of the last backward (a zero gradient for
    each param, then the all-reduce), 2.13/2.14 reduce nothing for it. `pending_reduction`, which
    the live counters issue from, says so before that backward, and FSDP2's state after it agrees."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accel_gradsync.compat import fsdp2 as internals
    from accel_gradsync.runtime.wrappers.fsdp2_state import param_groups, pending_reduction

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    net = _Skippable()
    fully_shard(net.first, mesh=mesh)
    fully_shard(net, mesh=mesh)
    adapter = FSDP2Adapter(net)
    first = next(u for u in adapter.units if u.name == "first")
    with adapter.hold(adapter.units, "all_reduce"):
        net(torch.ones(2, 4)).backward()
    (group,) = param_groups(first)
    partial = group._partial_reduce_output.clone()
    loss = net(torch.ones(2, 4), skip_first=True)
    reduces = internals.release().holds_in_grad  # 2.15
    expected = (0, 1, (4 * 4 + 4) * 4) if reduces else (0, 0, 0)  # one rank: no reduce-scatter
    assert pending_reduction(first, group, hsdp=True) == expected
    loss.backward()
    if reduces:
        assert group._partial_reduce_output is None
        assert torch.equal(torch.cat([p.grad.to_local().reshape(-1) for p in net.first.parameters()]), partial)
    else:
        assert torch.equal(group._partial_reduce_output, partial)
