"""Skipping FSDP2's idle forward work on kept units (runtime/wrappers/quiet_generation.py), on real
`fully_shard` models on a 1-rank gloo group (no mock): a root, two layers and a grouped tail
`fully_shard([norm, head])` as accelerate shards a transformer, under a mixed-precision policy that
casts inputs (bf16) and outputs (fp32). Every check compares with the same model kept unsharded
without the skip: outputs and dtypes at every forward, FSDP2's forward records, and the parameters
and bookkeeping after training steps that follow."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.wrappers.quiet_generation import NEEDED, skip_idle_forward_work

T = 6  # forwards without gradients, as decoded tokens
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.fail_at: int | None = None  # raise in the second layer's forward number `fail_at`
        self.calls = 0
        self.without_head = False  # return the norm's output: the grouped tail runs one of its modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i == 1:
                self.calls += 1
                if self.calls == self.fail_at:
                    raise RuntimeError("boom")
            h = torch.tanh(layer(h))
        h = self.norm(h)
        return h if self.without_head else self.head(h)


def build(policy: MixedPrecisionPolicy = POLICY, paramless_root: bool = False) -> tuple[Net, FSDP2Adapter]:
    """The model, FSDP2's lazy init done and every unit sharded, and its adapter. `paramless_root`:
    the embedding is a unit of its own, so the root holds no parameter and is no unit."""
    torch.manual_seed(0)
    net = Net()
    if paramless_root:
        fully_shard(net.embed, mp_policy=policy)
    for layer in net.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard([net.norm, net.head], reshard_after_forward=False, mp_policy=policy)  # accelerate's tail
    fully_shard(net, mp_policy=policy)
    with torch.no_grad():  # FSDP2's lazy init, then every unit sharded
        net(torch.zeros(1, 4))
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return net, FSDP2Adapter(net)


def inputs(step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(step))


def forward_records(net: Net) -> list[str]:
    """FSDP2's record of each param group's post-forwards since the last backward, by module name."""
    return [g._module_fqn for g in net._get_fsdp_state()._comm_ctx.post_forward_order]


def generate(net: Net, adapter: FSDP2Adapter, skip: bool) -> tuple[list[torch.Tensor], list, list[bool]]:
    """T forwards without gradients with every unit kept unsharded (and FSDP2's idle work skipped),
    then everything put back and resharded, as the plugin's generation does; the outputs, FSDP2's
    records of their forwards, and whether every unit was unsharded just before the restore."""
    keep = adapter.keep_params_through_forward(adapter.units)
    restore = skip_idle_forward_work(adapter, adapter.units) if skip else (lambda: None)
    earlier = len(forward_records(net))
    try:
        with torch.no_grad():
            outs = [net(inputs(t)) for t in range(T)]
        records = forward_records(net)[earlier:]
        unsharded = [all(g.is_unsharded for g in _groups(u.module)) for u in adapter.units]
    finally:
        restore()
        keep()
        adapter.reshard_unless_kept(adapter.units)
    return outs, records, unsharded


def train(net: Net, steps: int = 2) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        net(inputs(100 + step)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor() for p in net.parameters()]


def bookkeeping(net: Net) -> dict:
    """FSDP2's per-iteration state, by unit: training states, records of post-forwards."""
    out = {"order": len(forward_records(net))}
    for name, m in net.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = state._fsdp_param_groups
            out[name] = (
                state._training_state.name,
                [(g._training_state.name, list(g._post_forward_indices), g.is_unsharded) for g in groups],
            )
    return out


def training_states(net: Net) -> list[str]:
    """FSDP2's training state of every unit's state and param groups."""
    out = []
    for m in net.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            out += [state._training_state.name, *(g._training_state.name for g in state._fsdp_param_groups)]
    return out


def hooks_of(net: Net) -> list[list]:
    """Every module's forward pre-hooks and forward hooks: (key, hook) in order."""
    return [[list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())] for m in net.modules()]


def _groups(module: nn.Module) -> list:
    return module._get_fsdp_state()._fsdp_param_groups


@pytest.mark.compat
def test_this_torch_has_what_the_skip_reads(fsdp2_model):
    net, _ = build()
    for m in net.modules():
        if isinstance(m, FSDPModule):
            assert all(internals.has(m._get_fsdp_state(), name) for name in NEEDED)


@pytest.mark.compat
def test_outputs_are_bit_identical_and_fsdp_records_only_the_first_forward(fsdp2_model):
    (quiet, qa), (loud, la) = build(), build()
    outs, records, unsharded = generate(quiet, qa, skip=True)
    ref, ref_records, _ = generate(loud, la, skip=False)
    for a, b in zip(outs, ref, strict=True):
        assert a.dtype == b.dtype == torch.float32  # the root's output cast still applied
        assert torch.equal(a, b)
    assert all(unsharded)
    # Each forward records one post-forward per param group: 4 here (2 layers, tail, root). The
    # first forward gathers and runs FSDP2's hooks; the T - 1 after it run none.
    assert ref_records == ["layers.0", "layers.1", "norm, head", ""] * T
    assert records == ref_records[:4]


@pytest.mark.parametrize("policy", [POLICY, MixedPrecisionPolicy()], ids=["bf16_casts", "no_policy"])
def test_training_after_the_skip_is_bit_identical_and_fsdp_bookkeeping_matches(fsdp2_model, policy):
    (quiet, qa), (loud, la) = build(policy), build(policy)
    before = hooks_of(quiet)
    generate(quiet, qa, skip=True)
    generate(loud, la, skip=False)
    assert hooks_of(quiet) == before  # FSDP2's own hooks back, same keys, same order
    assert training_states(quiet) == training_states(loud)
    assert set(training_states(quiet)) == {"IDLE"}
    # The next forward with gradients records the same groups in the same order after the records
    # of generation's first forward, which the skip left as the only ones.
    skipped = len(forward_records(loud)) - len(forward_records(quiet))
    assert skipped == 4 * (T - 1)
    losses = [net(inputs(100)).square().sum() for net in (quiet, loud)]
    assert forward_records(quiet) == forward_records(loud)[skipped:]
    for loss in losses:
        loss.backward()
    for a, b in zip(quiet.parameters(), loud.parameters(), strict=True):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())
    quiet.zero_grad()
    loud.zero_grad()
    for a, b in zip(train(quiet), train(loud), strict=True):
        assert torch.equal(a, b)
    assert bookkeeping(quiet) == bookkeeping(loud)
    assert bookkeeping(quiet)["order"] == 0  # the last backward cleared FSDP2's records


def test_a_forward_with_gradients_runs_fsdp_hooks_before_the_restore(fsdp2_model):
    """The gates decide at each call: a forward with gradients before the restore (the plugin
    restores from inside such a forward, once its hooks are fixed) is a full FSDP2 forward."""
    (quiet, qa), (loud, la) = build(), build()
    keep = qa.keep_params_through_forward(qa.units)
    restore = skip_idle_forward_work(qa, qa.units)
    with torch.no_grad():
        quiet(inputs(0))
        quiet(inputs(1))
    loud_keep = la.keep_params_through_forward(la.units)
    with torch.no_grad():
        loud(inputs(0))
        loud(inputs(1))
    quiet(inputs(100)).square().sum().backward()  # gated, not restored yet
    loud(inputs(100)).square().sum().backward()
    restore(), keep(), loud_keep()
    for a, b in zip(quiet.parameters(), loud.parameters(), strict=True):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())
    assert bookkeeping(quiet) == bookkeeping(loud)


def test_a_unit_resharded_while_gated_gathers_again(fsdp2_model):
    (quiet, qa), (loud, _) = build(), build()
    keep = qa.keep_params_through_forward(qa.units)
    restore = skip_idle_forward_work(qa, qa.units)
    with torch.no_grad():
        first = quiet(inputs(0))
        quiet.layers[0].reshard()
        assert not _groups(quiet.layers[0])[0].is_unsharded
        second = quiet(inputs(1))
    assert _groups(quiet.layers[0])[0].is_unsharded  # FSDP2's pre-forward gathered it again
    restore(), keep()
    with torch.no_grad():
        assert torch.equal(first, loud(inputs(0)))
        assert torch.equal(second, loud(inputs(1)))


def test_an_exception_mid_generation_leaves_fsdp_consistent_and_restores(fsdp2_model):
    """A forward that raises between kept forwards: the restore puts FSDP2's hooks back, FSDP2's
    reset (what the plugin's release runs after an exception) finds nothing to undo, and training
    afterwards equals the run without the skip that raised at the same forward."""
    (quiet, qa), (loud, la) = build(), build()
    before = hooks_of(quiet)
    for net, adapter, skip in ((quiet, qa, True), (loud, la, False)):
        net.fail_at, net.calls = 3, 0  # the third forward
        with pytest.raises(RuntimeError, match="boom"):
            generate(net, adapter, skip)
        net.fail_at = None
        net.reset_iter_state()
    assert hooks_of(quiet) == before
    for a, b in zip(train(quiet), train(loud), strict=True):
        assert torch.equal(a, b)
    assert bookkeeping(quiet) == bookkeeping(loud)


def test_the_restore_is_idempotent_and_leaves_hooks_someone_else_put_back(fsdp2_model):
    net, adapter = build()
    pre = net.layers[0]._get_fsdp_state()._pre_forward_hook_handle
    hooks = pre.hooks_dict_ref()
    fsdp_hook = hooks[pre.id]
    restore = skip_idle_forward_work(adapter, adapter.units)
    assert hooks[pre.id] is not fsdp_hook
    restore()
    restore()
    assert hooks[pre.id] is fsdp_hook
    restore = skip_idle_forward_work(adapter, adapter.units)
    hooks[pre.id] = theirs = lambda *a: None  # noqa: E731 (a tool re-registering FSDP2's hooks)
    restore()
    assert hooks[pre.id] is theirs
    hooks[pre.id] = fsdp_hook


def root_forwards(net: Net, run) -> int:
    """How many times FSDP2's root pre-forward ran during `run()` (its profiler range)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.name == "FSDP::root_pre_forward" for e in prof.events())


def test_a_root_without_parameters_is_skipped_too(fsdp2_model):
    (quiet, qa), (loud, la) = build(paramless_root=True), build(paramless_root=True)
    assert "" not in [u.name for u in qa.units]  # the root is no unit
    quiet_outs, loud_outs = [], []
    assert root_forwards(quiet, lambda: quiet_outs.append(generate(quiet, qa, skip=True))) == 1
    assert root_forwards(loud, lambda: loud_outs.append(generate(loud, la, skip=False))) == T
    for a, b in zip(quiet_outs[0][0], loud_outs[0][0], strict=True):
        assert a.dtype == b.dtype == torch.float32  # the root's output cast still applied
        assert torch.equal(a, b)
    assert training_states(quiet) == training_states(loud)
    for a, b in zip(train(quiet), train(loud), strict=True):
        assert torch.equal(a, b)


def test_the_root_runs_fsdp_hooks_while_a_grouped_unit_is_not_idle(fsdp2_model):
    """A grouped unit resharded meanwhile runs FSDP2's hooks on the one module of it a forward
    runs; the root's post-forward completes it (skipped, the unit would stay mid-forward and its
    next forward with gradients would register no post-backward: its gradients never reduced)."""
    (quiet, qa), (loud, la) = build(), build()
    for net, adapter, skip in ((quiet, qa, True), (loud, la, False)):
        keep = adapter.keep_params_through_forward(adapter.units)
        restore = skip_idle_forward_work(adapter, adapter.units) if skip else (lambda: None)
        with torch.no_grad():
            net(inputs(0))
            net.norm.reshard()  # the grouped tail (norm, head)
            net.without_head = True
            net(inputs(1))
            net.without_head = False
        restore()
        keep()
        adapter.reshard_unless_kept(adapter.units)
    assert training_states(quiet) == training_states(loud)
    assert set(training_states(quiet)) == {"IDLE"}
    for a, b in zip(train(quiet), train(loud), strict=True):
        assert torch.equal(a, b)
