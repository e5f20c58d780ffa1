"""What each torch release does with a deferred gradient, on real `fully_shard` models on a 1-rank
gloo group (no mock): the dtype and bytes FSDP2 itself holds, read from its own tensors and
checked against the release's documented rule and the adapter's units; a window saved mid-step
and put back into a fresh model (plain and HSDP) resumes bit for bit; an aborted window leaves
nothing held; a parameter whose first gradient comes on the last micro-batch reduces with the
held ones. Every stack runs these on its own torch (-m compat): torch 2.15's paths on 2.15."""

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.compat.teardown import install_exit_guard
from accel_gradsync.runtime.wrappers import fsdp2_grads
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter

pytestmark = pytest.mark.compat

F32, BF16 = torch.float32, torch.bfloat16
POLICIES = {  # id: (param_dtype, reduce_dtype)
    "no-mp": (None, None),
    "bf16-no-reduce": (BF16, None),
    "bf16-fp32-reduce": (BF16, F32),
    "bf16-bf16-reduce": (BF16, BF16),
}
SERIES = internals.torch_series(torch.__version__)


def _expected_held_dtype(param_dtype, reduce_dtype):
    """The dtype FSDP2 documents for gradients accumulated with sync off, for fp32 parameters:
    `reduce_dtype` when set; else torch 2.15 keeps the parameter's dtype ("versionchanged:: 2.15
    ... gradients now follow the parameter's grad_dtype") and torch 2.13/2.14 the compute dtype."""
    if reduce_dtype is not None:
        return reduce_dtype
    if SERIES not in ("2.13", "2.14"):
        return F32
    return param_dtype or F32


@pytest.fixture(scope="module", autouse=True)
def gloo_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    install_exit_guard()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


BASE = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
INPUTS = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _model(policy=(None, None), mesh=None):
    param_dtype, reduce_dtype = policy
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    net = copy.deepcopy(BASE)
    fully_shard(net[0], mp_policy=mp, mesh=mesh)
    fully_shard(net, mp_policy=mp, mesh=mesh)
    return net, FSDP2Adapter(net)


def _fsdp2s_own_held_tensors(net):
    """Every unsharded gradient tensor FSDP2 keeps, read straight off its objects: the unsharded
    parameter's `.grad` and, where the release has it, the accumulated gradient."""
    found = []
    for module in (net, net[0]):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                accumulated = getattr(p, "unsharded_accumulated_grad", None)
                unsharded = getattr(p, "_unsharded_param", None)
                grad = None if unsharded is None else unsharded.grad
                if accumulated is not None and accumulated is not grad:  # 2.15's property forwards to .grad
                    found.append(accumulated)
                if grad is not None:
                    found.append(grad)
    return found


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_held_dtype_and_bytes_are_fsdp2s_own_and_the_releases_rule(policy):
    net, adapter = _model(POLICIES[policy])
    with adapter.hold(adapter.units):
        net(INPUTS[0]).sum().backward()
    held = _fsdp2s_own_held_tensors(net)
    numel = sum(p.numel() for p in BASE.parameters())  # 4*8+8 + 8+1 = 49 elements
    expected = _expected_held_dtype(*POLICIES[policy])
    assert {t.dtype for t in held} == {expected}, (torch.__version__, policy)
    assert sum(t.numel() for t in held) == numel
    assert fsdp2_grads.held_bytes(adapter.units) == numel * expected.itemsize
    assert {u.held_dtype for u in adapter.units} == {expected}
    assert sum(u.held_bytes for u in adapter.units) == numel * expected.itemsize
    assert {u.reduce_dtype for u in adapter.units} == {expected}  # FSDP2 reduce-scatters what it holds


@pytest.mark.parametrize("policy", ["no-mp", "bf16-no-reduce", "bf16-fp32-reduce"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_a_window_saved_mid_step_resumes_bit_exact_in_a_fresh_model(policy, hsdp):
    """Held for micro-batch 0, saved, then micro-batches 1 (held) and 2 (synced): the fresh model
    gets the saved gradients before its first forward (torch 2.15 has no unsharded parameter to
    hold them in yet) and ends with the very gradients of the uninterrupted one. HSDP holds only
    the all-reduce: its reduce-scattered partial sum is what is saved."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")) if hsdp else None
    what = "all_reduce" if hsdp else "gradient_sync"
    net, adapter = _model(POLICIES[policy], mesh)
    with adapter.hold(adapter.units, what):
        net(INPUTS[0]).sum().backward()
    saved = adapter.grad_state()
    with adapter.hold(adapter.units, what):
        net(INPUTS[1]).sum().backward()
    net(INPUTS[2]).sum().backward()
    fresh, resumed = _model(POLICIES[policy], mesh)
    resumed.load_grad_state(saved)
    with resumed.hold(resumed.units, what):
        fresh(INPUTS[1]).sum().backward()
    fresh(INPUTS[2]).sum().backward()
    for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_an_aborted_window_leaves_nothing_held_and_the_next_step_starts_fresh(hsdp):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")) if hsdp else None
    what = "all_reduce" if hsdp else "gradient_sync"
    net, adapter = _model(POLICIES["bf16-fp32-reduce"], mesh)
    with adapter.hold(adapter.units, what):
        net(INPUTS[0]).sum().backward()
    assert fsdp2_grads.held_bytes(adapter.units) > 0
    adapter.drop_held_grads()
    assert fsdp2_grads.held_bytes(adapter.units) == 0 and not _fsdp2s_own_held_tensors(net)
    assert all(p.grad is None for p in net.parameters())
    net(INPUTS[1]).sum().backward()
    reference, _ = _model(POLICIES["bf16-fp32-reduce"], mesh)
    reference(INPUTS[1]).sum().backward()
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())


class _Branchy(torch.nn.Module):
    """One unit whose `late` weight gets a gradient only when `use_late` is set."""

    def __init__(self):
        super().__init__()
        self.early = torch.nn.Linear(4, 4)
        self.late = torch.nn.Linear(4, 4)

    def forward(self, x, use_late=False):
        y = self.early(x)
        return (self.late(y) if use_late else y).sum()


def test_a_first_gradient_on_the_last_micro_batch_reduces_with_the_held_ones():
    """bf16 compute, fp32 reduce: `late` gets its first gradient on the synced micro-batch after a
    held one. torch 2.13/2.14 assert one gradient dtype per reduce-scatter, so `late` gets a zero
    fp32 gradient after the held backward (2 params filled); torch 2.15 reduces mixed dtypes and
    nothing is filled. Either way the gradients are the per-micro-batch run's."""
    torch.manual_seed(0)
    base = _Branchy()
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32)
    runs = []
    for hold in (True, False):
        net = copy.deepcopy(base)
        fully_shard(net, mp_policy=mp)
        adapter = FSDP2Adapter(net)
        if hold:
            with adapter.hold(adapter.units):
                net(INPUTS[0]).backward()
            filled = adapter.even_out_held_grads(adapter.units)
            assert filled == (0 if internals.release().holds_in_grad else 2)
        else:
            net(INPUTS[0]).backward()
        net(INPUTS[1], use_late=True).backward()
        runs.append([p.grad.full_tensor() for p in net.parameters()])
    for held, synced in zip(*runs, strict=True):
        torch.testing.assert_close(held, synced, rtol=1e-2, atol=1e-2)  # bf16 compute, summed in fp32 both ways


def test_a_unit_never_gathered_can_hold_where_the_release_casts_on_the_parameter():
    """torch 2.13/2.14 cannot hold a unit whose held gradient is cast before its first all-gather
    (their post-backward fails), so it syncs until it has run once; 2.15 holds any unit."""
    net, adapter = _model(POLICIES["bf16-fp32-reduce"])
    expected = adapter.units if internals.release().holds_in_grad else []
    assert adapter.holdable(adapter.units) == expected
    net(INPUTS[0]).sum().backward()
    assert adapter.holdable(adapter.units) == adapter.units
