"""Adapters over the three wrappers: FSDP2 (`fully_shard`), FSDP1 (`FullyShardedDataParallel`), DDP.

An adapter lists a model's *units* (the modules whose gradients one collective reduces) and,
for FSDP2, holds the gradient sync of any subset of them for one micro-batch. FSDP1 and DDP
can only defer everything at once, through the root's `no_sync()`, which accelerate already
calls correctly; `root_only` tells the caller to reuse it.

FSDP2 has setters for its per-unit flags but no getters, so `_sync_flags` reads them back from
the param groups the setters write. Those reads, a param group's sharded and training state and
pending all-gather (the live counters, fsdp2_counts.py), the dtypes, held gradient tensors and
owning modules of FSDP2's params and FSDP1's flat parameter are the only private torch attributes
this package reads, all in this module but FSDP2's forward hooks (quiet_generation.py); FSDP2's go
through `compat/fsdp2.py`, which says where each torch series keeps them (`internals.read(obj, name)`).
It writes private state in two places only, both where torch has no API and would otherwise give
wrong gradients or crash: `even_out_held_grads` (FSDP2's uniform-dtype assertion) and
`drop_held_grads` (gradients of an aborted accumulation that `zero_grad` cannot reach).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.nn.parallel import DistributedDataParallel

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.compat.versions import describe_tested_torch
from accel_gradsync.planning.costs import unit_dtypes
from accel_gradsync.planning.units import Unit


class ModelAdapter:
    """Base adapter: the wrapper's kind, its units and how their sync is held."""

    kind: str = ""
    collective: str = "reduce_scatter"
    root_only: bool = False
    """True where deferral is all-or-nothing through the root's `no_sync()` (FSDP1, DDP)."""
    hsdp: bool = False
    """True when the mesh has a replicate dimension: gradients are also all-reduced across replicas."""
    backend: str = ""
    """The process-group backend the units reduce over ("nccl", "hccl", "gloo"; FSDP2)."""
    keeps_params_when_held: bool = False
    """FSDP1 SHARD_GRAD_OP: `no_sync()` keeps the params unsharded, so a held micro-batch skips the
    next forward's all-gather (FSDP2 does it per unit, in a window: see `FSDP2Adapter.hold`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.units: list[Unit] = self._find_units(model)
        self.replicated: list[nn.Parameter] = []
        """Trainable parameters the wrapper does not shard: FSDP2's root found under a wrapper
        holds those added after sharding (a PEFT adapter on a model transformers sharded at load
        time), which no unit reduces; transformers' Trainer all-reduces them itself."""

    @property
    def trainable(self) -> bool:
        """Some unit, or a parameter outside the units, has a gradient to sync (a frozen reference
        model has none)."""
        return any(not u.frozen for u in self.units) or bool(self.replicated)

    def _find_units(self, model: nn.Module) -> list[Unit]:
        raise NotImplementedError

    def hold(
        self, units: Sequence[Unit], what: str = "gradient_sync", windowed: Sequence[Unit] = ()
    ) -> contextlib.AbstractContextManager:
        """Skip the sync of `units` for the enclosed forward and backward: the whole
        `gradient_sync`, or (HSDP) only the cross-replica `all_reduce`; keep the params of the
        `windowed` ones unsharded through it (FSDP2)."""
        raise NotImplementedError

    def keep_params_through_forward(self, units: Sequence[Unit]) -> Callable[[], None]:
        """Before the last micro-batch's forward: keep the params of `units` unsharded through it,
        so its backward gathers nothing. Returns the call that restores the flags after forward."""
        return lambda: None

    def reshard(self, units: Sequence[Unit]) -> None:
        """Free the unsharded params of `units` (after an aborted window)."""

    def unit_modules(self) -> list[tuple[nn.Module, Unit]]:
        """Every module FSDP2 runs a unit's pre-forward on, with its unit (a grouped
        `fully_shard([a, b])` unit has several); empty for other wrappers."""
        return []

    def reshard_unless_kept(self, units: Sequence[Unit]) -> list[Unit]:
        """Reshard those of `units` whose flags say they reshard after forward; returns them."""
        return []

    def unsharded_now(self) -> frozenset[int]:
        """The `id` of each unit whose params are unsharded right now, where the live counters
        need it (FSDP1: a forward without gradients leaves the root gathered); empty elsewhere."""
        return frozenset()

    def reshards_now(self, unit: Unit) -> bool:
        """The unit's flags say it reshards after its next forward (a window or generation can
        keep it; `unit.reshards_after_forward` is what it was given)."""
        return unit.reshards_after_forward

    def reset_after_exception(self) -> bool:
        """Reset the wrapper after an exception inside a forward; False where it cannot."""
        return False

    def holdable(self, units: Sequence[Unit]) -> list[Unit]:
        """The `units` whose sync can be held on this micro-batch (all, unless a wrapper says not)."""
        return list(units)

    def even_out_held_grads(self, units: Sequence[Unit]) -> int:
        """Make held gradients safe to reduce together later (see FSDP2); 0 where nothing to do."""
        return 0

    def drop_held_grads(self) -> None:
        """Discard every gradient of an aborted accumulation: `.grad`, and what the wrapper holds
        elsewhere (FSDP2's unsharded and accumulated gradients, HSDP partial sums)."""
        self.model.zero_grad(set_to_none=True)

    def grad_state(self) -> list | None:
        """This rank's gradients of the window in progress, wherever the wrapper keeps them, for
        a mid-window checkpoint; None where the wrapper cannot give them back."""
        return [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def load_grad_state(self, state: list) -> None:
        """Put `grad_state()`'s gradients back before the window continues."""
        for p, grad in zip(self.model.parameters(), state, strict=True):
            p.grad = None if grad is None else grad.to(p.device)

    def held_grad_bytes(self) -> int:
        """Bytes of unsharded gradient the wrapper holds right now, read from the tensors it
        keeps (sizes only: no device synchronisation)."""
        raise NotImplementedError


class FSDP2Adapter(ModelAdapter):
    """`fully_shard` models: every `FSDPModule` is a unit (a frozen one too: it all-gathers like
    the others), and a trainable unit's sync can be held on its own with
    `set_requires_gradient_sync(False, recurse=False)`."""

    kind = "fsdp2"

    def _find_units(self, model: nn.Module) -> list[Unit]:
        check_fsdp2_internals(model)
        units, seen = [], set()
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            # `fully_shard([a, b, c])` (accelerate does it for tied embeddings and the final norm)
            # gives several modules one state and one param group: one unit, one reduce-scatter.
            state = module._get_fsdp_state()
            if id(state) in seen:
                continue
            seen.add(id(state))
            groups = _groups(state)
            everything = [p for g in groups for p in _params(g)]
            if not everything:
                continue  # a module fully_shard gave no parameter of its own: nothing to gather
            params = [p for p in everything if _param_now(p).requires_grad]
            numel = sum(_sharded(p).numel() for p in params)  # DTensor: the global size
            policy = internals.read(groups[0], "mp_policy")
            first = _sharded((params or everything)[0])
            held, reduce, compute = unit_dtypes("fsdp2", first.dtype, policy.param_dtype, policy.reduce_dtype)
            if not params:
                held = reduce = compute  # a frozen unit holds and reduces nothing
            mesh = first.device_mesh  # HSDP: (replicate, shard)
            self.backend = self.backend or str(torch.distributed.get_backend(mesh.get_group(mesh.ndim - 1)))
            self.hsdp = self.hsdp or mesh.ndim == 2
            shard = mesh.size(mesh.ndim - 1)
            # The root keeps its params after forward where fully_shard chose for it (FSDP2's lazy
            # init: reshard_after_forward None, as accelerate shards its root); a root given True
            # (TRL's prepare_fsdp of a reference model) reshards like any unit.
            auto_root = name == "" and internals.read(state, "auto_reshard_after_forward")
            reshards = not auto_root and all(internals.read(g, "post_forward_mesh_info") is not None for g in groups)
            reducing = sum(any(_param_now(p).requires_grad for p in _params(g)) for g in groups)
            units.append(
                Unit(
                    name,
                    cast(nn.Module, module),
                    numel,
                    reducing,
                    held_dtype=held,
                    reduce_dtype=reduce,
                    compute_dtype=compute,
                    shard_size=shard,
                    sharded_numel=sum(dim0_shard_numel(_sharded(p).shape, shard) for p in params),
                    param_numel=sum(_sharded(p).numel() for p in everything),
                    reshards_after_forward=reshards,
                )
            )
        return units

    def held_grad_bytes(self) -> int:
        total = 0
        for unit in self.units:
            for group in _groups(_fsdp2(unit.module)._get_fsdp_state()):
                # HSDP with the all-reduce held: the sharded partial sum of the reduce-scatters.
                partial = internals.read(group, "partial_reduce_output")
                if partial is not None:
                    total += partial.numel() * partial.element_size()
                for p in _params(group):
                    grad = _held_grad(p)
                    if grad is not None:
                        total += grad.numel() * grad.element_size()
        return total

    def holdable(self, units: Sequence[Unit]) -> list[Unit]:
        """The `units` FSDP2 can hold right now. torch 2.13 fails in its post-backward
        (`to_accumulated_grad_if_needed`) on a unit that was never all-gathered, when a held
        gradient must be cast to `reduce_dtype`: such a unit syncs until it has run once."""
        return [
            u
            for u in units
            if u.held_dtype == u.compute_dtype
            or all(internals.has(p, "unsharded_param") for p in _fsdp_params(_fsdp2(u.module)))
        ]

    def even_out_held_grads(self, units: Sequence[Unit]) -> int:
        """After a held backward: in each unit whose held gradients are cast to `reduce_dtype`,
        give the params that got no gradient yet a zero one in that dtype, so a first gradient
        on a later micro-batch joins a uniform reduce-scatter (torch 2.13 asserts "FSDP
        reduce-scatter expects uniform gradient dtype" otherwise). Returns how many it filled.
        Such a param then ends the step with a zero gradient rather than None."""
        filled = 0
        for unit in units:
            if unit.held_dtype == unit.compute_dtype:
                continue
            params = _fsdp_params(_fsdp2(unit.module))
            if not any(internals.read(p, "unsharded_accumulated_grad") is not None for p in params):
                continue
            for p in params:
                if (
                    internals.read(p, "unsharded_accumulated_grad") is None
                    and internals.has(p, "unsharded_param")
                    and internals.read(p, "unsharded_param").grad is None
                    and _sharded(p).requires_grad
                ):
                    zeros = torch.zeros(
                        internals.read(p, "orig_size"), dtype=unit.held_dtype, device=_sharded(p).device
                    )
                    internals.write(p, "unsharded_accumulated_grad", zeros)
                    filled += 1
        return filled

    def drop_held_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for unit in self.units:
            for group in _groups(_fsdp2(unit.module)._get_fsdp_state()):
                internals.write(group, "partial_reduce_output", None)
                for p in _params(group):
                    internals.write(p, "unsharded_accumulated_grad", None)
                    if internals.has(p, "unsharded_param"):
                        internals.read(p, "unsharded_param").grad = None

    def grad_state(self) -> list:
        state = []
        for unit in self.units:
            for group in _groups(_fsdp2(unit.module)._get_fsdp_state()):
                params = []
                for p in _params(group):
                    held = _held_grad(p)
                    sharded = _sharded(p).grad
                    params.append(
                        (
                            None if held is None else held.detach().clone(),
                            None if sharded is None else sharded.to_local().detach().clone(),
                        )
                    )
                partial = internals.read(group, "partial_reduce_output")
                state.append((params, None if partial is None else partial.detach().clone()))
        return state

    def load_grad_state(self, state: list) -> None:
        from torch.distributed.tensor import DTensor

        groups = [g for u in self.units for g in _groups(_fsdp2(u.module)._get_fsdp_state())]
        if len(groups) != len(state):
            raise ValueError(
                f"the checkpoint's window gradients are for {len(state)} FSDP2 param groups, this model has "
                f"{len(groups)}: it was saved from a different model or wrapping. Load it into the model it was "
                "saved from, or delete its accel_gradsync_grads_rank*.pt files to resume at the last optimizer step."
            )
        for group, (params, partial) in zip(groups, state, strict=True):
            internals.write(group, "partial_reduce_output", partial)
            for p, (held, sharded) in zip(_params(group), params, strict=True):
                # FSDP2 adds later micro-batches' gradients to `unsharded_accumulated_grad` and
                # reduce-scatters it on the last one, whatever the dtypes.
                internals.write(p, "unsharded_accumulated_grad", held)
                if sharded is not None:
                    sp = _sharded(p)
                    sp.grad = DTensor.from_local(
                        sharded.to(sp.device),
                        sp.device_mesh,
                        sp.placements,
                        run_check=False,
                        shape=sp.shape,
                        stride=sp.stride(),
                    )

    @contextlib.contextmanager
    def hold(self, units: Sequence[Unit], what: str = "gradient_sync", windowed: Sequence[Unit] = ()) -> Iterator[None]:
        # Each unit gets back exactly the flags it had (not blindly True): one the user switched
        # off stays off, and an exception leaves nothing held. Others are not touched.
        saved = [(_fsdp2(u.module), _sync_flags(_fsdp2(u.module))) for u in units]
        restore_forward = self.keep_params_through_forward(windowed) if windowed else None
        try:
            for u in units:
                if what == "all_reduce":
                    _fsdp2(u.module).set_requires_all_reduce(False, recurse=False)
                else:
                    _fsdp2(u.module).set_requires_gradient_sync(False, recurse=False)
            for u in windowed:
                # Unsharded from this forward until the window's last backward: no all-gather in
                # this backward nor in the next micro-batch's forward.
                _fsdp2(u.module).set_reshard_after_backward(False, recurse=False)
            yield
        finally:
            if restore_forward is not None:
                restore_forward()
            for module, (reduce_grads, all_reduce_grads, reshard) in saved:  # FSDPModules
                module.set_requires_gradient_sync(reduce_grads, recurse=False)
                if all_reduce_grads != reduce_grads:  # the setter above set both to reduce_grads
                    module.set_requires_all_reduce(all_reduce_grads, recurse=False)
                if windowed:
                    module.set_reshard_after_backward(reshard, recurse=False)

    def keep_params_through_forward(self, units: Sequence[Unit]) -> Callable[[], None]:
        # torch's setter cannot express what it replaces (the root's automatic False, or a
        # reshard to a smaller mesh), so the exact previous state is put back directly.
        states = [_fsdp2(u.module)._get_fsdp_state() for u in units if u.reshards_after_forward]
        saved = [
            (
                s,
                internals.read(s, "auto_reshard_after_forward"),
                [internals.read(g, "post_forward_mesh_info") for g in _groups(s)],
            )
            for s in states
        ]
        for u in units:
            if u.reshards_after_forward:
                _fsdp2(u.module).set_reshard_after_forward(False, False)  # `recurse` is positional in torch 2.13

        def restore() -> None:
            for state, auto, infos in saved:
                internals.write(state, "auto_reshard_after_forward", auto)
                for group, info in zip(_groups(state), infos, strict=True):
                    internals.write(group, "post_forward_mesh_info", info)

        return restore

    def reshard(self, units: Sequence[Unit]) -> None:
        for u in units:
            _fsdp2(u.module).reshard()

    def unit_modules(self) -> list[tuple[nn.Module, Unit]]:
        by_state = {id(_fsdp2(u.module)._get_fsdp_state()): u for u in self.units}
        return [
            (m, by_state[id(m._get_fsdp_state())])
            for m in self.model.modules()
            if isinstance(m, FSDPModule) and id(m._get_fsdp_state()) in by_state
        ]

    def reshards_now(self, unit: Unit) -> bool:
        # No public getter for reshard_after_forward: read it where its setter writes it.
        groups = _groups(_fsdp2(unit.module)._get_fsdp_state())
        return all(internals.read(g, "post_forward_mesh_info") is not None for g in groups)

    def fsdp_root(self) -> nn.Module:
        """The outermost FSDP2 module: its post-forward completes the units left incomplete."""
        return next(m for m in self.model.modules() if isinstance(m, FSDPModule))

    def reshard_unless_kept(self, units: Sequence[Unit]) -> list[Unit]:
        done = [u for u in units if self.reshards_now(u)]
        self.reshard(done)
        return done

    def reset_after_exception(self) -> bool:
        reset = getattr(self.model, "reset_iter_state", None)  # public in torch 2.13
        if reset is None:
            return False
        reset()
        return True


# What FSDP2 issues next, read from its private state for the live counters (fsdp2_counts.py).


def pending_all_gathers(unit: Unit) -> Callable[[], int]:
    """A call that says how many all-gathers FSDP2 issues for `unit` if its forward or backward
    runs now (fsdp2_counts.py): one per param group whose params are not unsharded (sharded,
    resharded to a smaller mesh after forward, or prefetched and not waited for yet); none on a
    mesh of one rank. Attribute reads only: it runs before every forward and backward."""
    groups, flag = param_groups(unit), internals.attribute("is_unsharded")
    if unit.shard_size == 1:
        return lambda: 0
    return lambda: sum(not getattr(g, flag) for g in groups)


def unsharded(group) -> bool:
    """`group`'s params are unsharded now (a prefetch not waited for yet does not count)."""
    return bool(internals.read(group, "is_unsharded"))


def param_groups(unit: Unit) -> list:
    """The unit's param groups: each post-backwards and reduces on its own."""
    return _groups(_fsdp2(unit.module)._get_fsdp_state())


def pending_reduction(unit: Unit, group, hsdp: bool) -> tuple[int, int, int]:
    """(reduce-scatters, all-reduces, gradient bytes) that `group`'s post-backward issues if it
    runs now: none while its sync is held; else one of each (the all-reduce under HSDP while
    not held) when it finds a gradient, held from earlier micro-batches or computed since."""
    if not internals.read(group, "reduce_grads"):
        return 0, 0, 0
    numel = sum(
        _sharded(p).numel() for p in _params(group) if internals.has(p, "unsharded_param") and _held_grad(p) is not None
    )
    if not numel:
        return 0, 0, 0
    all_reduces = int(hsdp and internals.read(group, "all_reduce_grads"))
    return int(unit.shard_size > 1), all_reduces, numel * unit.reduce_dtype.itemsize


def forwards_left(unit: Unit) -> bool:
    """A grouped unit (`fully_shard([a, b])`) some of whose modules did not run this forward:
    FSDP completes its post-forward in the root's, with its pre-backward on the root's outputs."""
    return bool(internals.read(_fsdp2(unit.module)._get_fsdp_state(), "modules_to_run_forward", ()))


def unused_prefetch(unit: Unit, group) -> bool:
    """At the end of a backward: `group` was all-gathered ahead of use (a backward prefetch of a
    unit this backward does not run, e.g. the one an evaluation ran last) and nothing waited for
    it; FSDP drops it at its end-of-backward callback."""
    return unit.shard_size > 1 and internals.read(group, "all_gather_result") is not None


def ran_post_backward(group) -> bool:
    """`group` ran its post-backward in the backward in progress (FSDP's end-of-backward
    callback then skips it)."""
    return internals.read(group, "training_state").name == "POST_BACKWARD"


def post_backward_group(node) -> object | None:
    """The param group whose post-backward the autograd `node` runs (FSDP2's pre-forward puts
    one on a unit's inputs that need gradients), else None."""
    if getattr(getattr(node, "_forward_cls", None), "__name__", "") != "RegisterPostBackwardFunction":
        return None
    return getattr(node, "param_group", None)


class FSDP1Adapter(ModelAdapter):
    """`FullyShardedDataParallel` models: one unit per FSDP instance that owns a flat parameter
    (a frozen one too).
    `no_sync()` is only valid on the root and keeps the unsharded flat gradient in the compute
    dtype; under SHARD_GRAD_OP it also keeps the parameters unsharded."""

    kind = "fsdp1"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        units = []
        for name, module in model.named_modules():
            handle = getattr(module, "_handle", None) if isinstance(module, FSDP1) else None
            if handle is not None:
                # A frozen flat parameter reduces nothing but is all-gathered all the same.
                param_numel = handle.flat_param._unpadded_unsharded_size.numel()
                numel = param_numel if handle.flat_param.requires_grad else 0
                policy = module.mixed_precision
                held, reduce, compute = unit_dtypes(
                    "fsdp1", handle.flat_param.dtype, policy.param_dtype, policy.reduce_dtype
                )
                shard = handle.world_size if handle.uses_sharded_strategy else 1
                full_shard = handle._sharding_strategy.name in ("FULL_SHARD", "HYBRID_SHARD")
                # SHARD_GRAD_OP keeps params unsharded after forward, and under no_sync after backward.
                self.keeps_params_when_held = (
                    self.keeps_params_when_held or handle._sharding_strategy.name == "SHARD_GRAD_OP"
                )
                units.append(
                    Unit(
                        name,
                        module,
                        numel,
                        int(numel > 0),
                        held_dtype=held,
                        reduce_dtype=reduce,
                        compute_dtype=compute,
                        shard_size=shard,
                        sharded_numel=-(-numel // shard),
                        param_numel=param_numel,
                        reshards_after_forward=full_shard and name != "",
                    )
                )
        return units

    def drop_held_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for unit in self.units:
            _flat_param(unit).grad = None

    def unsharded_now(self) -> frozenset[int]:
        # NOTE: needs_unshard() is False once the padded unsharded storage exists (and for NO_SHARD);
        # it reads `_full_param_padded`, which FSDP1 creates at its lazy init (the first forward).
        return frozenset(
            id(u)
            for u in self.units
            if hasattr(_flat_param(u), "_full_param_padded") and not _handle(u).needs_unshard()
        )

    def grad_state(self) -> None:
        return None  # FSDP1's flat gradient views cannot be put back from outside

    def held_grad_bytes(self) -> int:
        # Under no_sync FSDP1 leaves the unsharded flat gradient on `flat_param.grad`.
        total = 0
        for unit in self.units:
            grad = _flat_param(unit).grad
            if grad is not None:
                total += grad.numel() * grad.element_size()
        return total


class DDPAdapter(ModelAdapter):
    """`DistributedDataParallel`: the whole model is one unit, all-reduced in buckets whose
    count DDP decides at the first backward; `no_sync()` skips all of them."""

    kind = "ddp"
    collective = "all_reduce"
    root_only = True

    def _find_units(self, model: nn.Module) -> list[Unit]:
        params = [p for p in model.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        numel = sum(p.numel() for p in params)
        return [Unit("", model, numel, 1, dtype, dtype, dtype, shard_size=1, sharded_numel=numel)]

    def held_grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)


def dim0_shard_numel(shape: Sequence[int], shard_size: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter: dim 0 padded to a multiple of the shard size."""
    if not shape:
        return 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // shard_size) * rest


def adapt_model(model: nn.Module) -> ModelAdapter | None:
    """The adapter for a prepared model, or None when it is not wrapped for data parallelism. A
    module around an FSDP2 root (PEFT's `PeftModel` around a model transformers sharded at load
    time) is adapted by that root, with its trainable parameters outside the units."""
    if isinstance(model, FSDPModule):
        return FSDP2Adapter(model)
    if isinstance(model, FSDP1):
        return FSDP1Adapter(model)
    if isinstance(model, DistributedDataParallel):
        return DDPAdapter(model)
    root = fsdp2_root_inside(model)
    if root is None:
        return None
    from torch.distributed.tensor import DTensor

    adapter = FSDP2Adapter(root)
    adapter.replicated = [p for p in root.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    return adapter


def fsdp2_root_inside(model: nn.Module) -> nn.Module | None:
    """The FSDP2 root inside a module that is not one itself: its outermost `FSDPModule`, when
    every other one is inside it; None where there is none (or several side by side)."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    root = sharded[0]  # modules() walks parents before children
    inside = set(root.modules())
    return root if all(m in inside for m in sharded) else None


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """True when the model or any submodule is sharded by FSDP1 or FSDP2."""
    return any(isinstance(m, (FSDPModule, FSDP1)) for m in model.modules())


def check_fsdp2_internals(model: nn.Module) -> None:
    """Raise, naming the torch version and what is missing, when this torch's FSDP2 lacks a private
    attribute the adapter relies on where `compat/fsdp2.py` says this torch series keeps it (a
    series with no entry there is checked against the newest one)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        missing = internals.missing({internals.STATE: state})
        if missing is None:
            groups = _groups(state)
            if not groups:
                continue
            params = _params(groups[0])
            missing = internals.missing({internals.GROUP: groups[0], internals.PARAM: next(iter(params), None)})
        if missing is not None:
            raise RuntimeError(
                f"accel_gradsync reads FSDP2's private {missing}, which torch {torch.__version__} does not "
                f"have (tested: {describe_tested_torch()}; accel_gradsync/compat/fsdp2.py says where each keeps it). "
                "Install a tested torch, or use sync_mode 'per_micro_batch' without attach()."
            )
        return  # one unit tells: every FSDP2 state of a torch release has the same fields


def _handle(unit: Unit) -> Any:
    """The `FlatParamHandle` of one FSDP1 unit (every unit has one: `_find_units` keeps only those)."""
    handle = cast(FSDP1, unit.module)._handle
    assert handle is not None
    return handle


def _flat_param(unit: Unit) -> nn.Parameter:
    """The flat parameter one FSDP1 unit owns."""
    return _handle(unit).flat_param


def _fsdp2(module: nn.Module) -> FSDPModule:
    """A unit's module as what FSDP2 made it (`fully_shard` changes its class to FSDP<cls>)."""
    return cast(FSDPModule, module)


def _groups(state) -> list:
    """An FSDP2 state's param groups."""
    return internals.read(state, "param_groups")


def _params(group) -> list:
    """The FSDPParams of one param group."""
    return internals.read(group, "fsdp_params")


def _sharded(p) -> Any:
    """An FSDPParam's sharded parameter (a DTensor)."""
    return internals.read(p, "sharded_param")


def _held_grad(p) -> torch.Tensor | None:
    """The unsharded gradient an FSDPParam holds: accumulated in `reduce_dtype`, else on its
    unsharded parameter (absent until its first all-gather); None when it holds none."""
    grad = internals.read(p, "unsharded_accumulated_grad")
    if grad is None and internals.has(p, "unsharded_param"):
        grad = internals.read(p, "unsharded_param").grad
    return grad


def _param_now(p) -> nn.Parameter:
    """The parameter an FSDPParam stands for, as its module holds it now. transformers' load-time
    sharding puts the loaded weights in after `fully_shard`, and FSDP2 takes the new parameter up
    as `sharded_param` only at its lazy init (the first forward): until then `sharded_param` is
    the replaced one, whose `requires_grad` PEFT's freezing never reached."""
    info = internals.read(p, "module_info")
    return getattr(info.module, info.param_name)


def _fsdp_params(module: FSDPModule) -> list:
    """The FSDPParams one FSDP2 unit manages directly."""
    return [p for g in _groups(module._get_fsdp_state()) for p in _params(g)]


def _sync_flags(module: FSDPModule) -> tuple[bool, bool, bool]:
    """(requires_gradient_sync, requires_all_reduce, reshard_after_backward) of one FSDP2 unit,
    as its setters left them."""
    groups = _groups(module._get_fsdp_state())
    return (
        all(internals.read(g, "reduce_grads") for g in groups),
        all(internals.read(g, "all_reduce_grads") for g in groups),
        all(internals.read(g, "reshard_after_backward") for g in groups),
    )


def sharded_by_transformers(trainer: Any) -> bool:
    """True when `trainer`'s model was sharded at load time by transformers (`DistributedConfig`)."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))
