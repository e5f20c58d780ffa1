"""`FSDP2Adapter`: the units of a `fully_shard` model and how each one's sync is held.

Every `FSDPModule` state is a unit (a frozen one too: it all-gathers like the others); a trainable
unit's sync is held on its own with `set_requires_gradient_sync(False, recurse=False)` (HSDP:
`set_requires_all_reduce`), and a windowed unit keeps its params with
`set_reshard_after_backward(False)` / `set_reshard_after_forward(False)`. FSDP2's private state is
read through fsdp2_state.py and compat/fsdp2.py; the gradients it holds are handled in
fsdp2_grads.py. The one write here, `keep_params_through_forward`'s restore, puts back flags
torch's setter cannot express.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.planning.costs import unit_dtypes
from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.wrappers import fsdp2_grads
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter, dim0_shard_numel
from accel_gradsync.runtime.wrappers.fsdp2_state import (
    as_fsdp2,
    check_fsdp2_internals,
    grad_dtype_of,
    group_params,
    param_groups,
    param_now,
    sharded_param,
    state_groups,
    sync_flags,
    unit_params,
    unsharded,
)


class FSDP2Adapter(ModelAdapter):
    """`fully_shard` models: every `FSDPModule` is a unit (a frozen one too: it all-gathers like
    the others), and a trainable unit's sync can be held on its own with
    `set_requires_gradient_sync(False, recurse=False)`."""

    kind = "fsdp2"

    def __init__(self, model: nn.Module, torch_release: str | None = None) -> None:
        self.torch_release = torch_release
        """The torch series whose dtype rules the units' held and reduce dtypes follow (the
        estimate's `--torch`); None: the running torch's. Everything else is the running torch's."""
        super().__init__(model)

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
            groups = state_groups(state)
            everything = [p for g in groups for p in group_params(g)]
            if not everything:
                continue  # a module fully_shard gave no parameter of its own: nothing to gather
            params = [p for p in everything if param_now(p).requires_grad]
            numel = sum(sharded_param(p).numel() for p in params)  # DTensor: the global size
            # The first trainable parameter's policy and dtypes stand for the unit's (torch 2.15
            # resolves a policy per parameter; a unit mixing dtypes is planned by its first).
            policy = internals.read((params or everything)[0], "mp_policy")
            first = sharded_param((params or everything)[0])
            held, reduce, compute = unit_dtypes(
                "fsdp2",
                first.dtype,
                policy.param_dtype,
                policy.reduce_dtype,
                torch_release=self.torch_release,
                grad_dtype=grad_dtype_of(first),
            )
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
            reducing = sum(any(param_now(p).requires_grad for p in group_params(g)) for g in groups)
            kept = not any(internals.read(g, "reshard_after_backward") for g in groups)
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
                    sharded_numel=sum(dim0_shard_numel(sharded_param(p).shape, shard) for p in params),
                    param_numel=sum(sharded_param(p).numel() for p in everything),
                    reshards_after_forward=reshards,
                    resident=not params and not reshards and kept,
                )
            )
        return units

    def held_grad_bytes(self) -> int:
        return fsdp2_grads.held_bytes(self.units)

    def holdable(self, units: Sequence[Unit]) -> list[Unit]:
        """The `units` FSDP2 can hold right now. torch 2.13/2.14 fail in their post-backward
        (`to_accumulated_grad_if_needed`) on a unit that was never all-gathered, when a held
        gradient must be cast to `reduce_dtype`: such a unit syncs until it has run once. torch
        2.15 casts on the unsharded parameter itself and holds any unit."""
        if internals.release().holds_in_grad:
            return list(units)
        return [
            u
            for u in units
            if u.held_dtype == u.compute_dtype
            or all(internals.has(p, "unsharded_param") for p in unit_params(as_fsdp2(u.module)))
        ]

    def even_out_held_grads(self, units: Sequence[Unit]) -> int:
        return fsdp2_grads.even_out(units)

    def drop_held_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)
        # NOTE: zero_grad reaches the parameters a unit registers now: a unit the exception left
        # unsharded shows its unsharded ones, and the gradients reduced into its shards survive.
        for unit in self.units:
            for p in unit_params(as_fsdp2(unit.module)):
                sharded_param(p).grad = None
        fsdp2_grads.drop(self.units, self.fsdp_root())

    def grad_state(self) -> list:
        return fsdp2_grads.save(self.units)

    def load_grad_state(self, state: list) -> None:
        fsdp2_grads.load(self.units, state)

    @contextlib.contextmanager
    def hold(self, units: Sequence[Unit], what: str = "gradient_sync", windowed: Sequence[Unit] = ()) -> Iterator[None]:
        # Each unit gets back exactly the flags it had (not blindly True): one the user switched
        # off stays off, and an exception leaves nothing held. Others are not touched.
        saved = [(as_fsdp2(u.module), sync_flags(as_fsdp2(u.module))) for u in units]
        restore_forward = self.keep_params_through_forward(windowed) if windowed else None
        try:
            for u in units:
                if what == "all_reduce":
                    as_fsdp2(u.module).set_requires_all_reduce(False, recurse=False)
                else:
                    as_fsdp2(u.module).set_requires_gradient_sync(False, recurse=False)
            for u in windowed:
                # Unsharded from this forward until the window's last backward: no all-gather in
                # this backward nor in the next micro-batch's forward.
                as_fsdp2(u.module).set_reshard_after_backward(False, recurse=False)
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
        states = [as_fsdp2(u.module)._get_fsdp_state() for u in units if u.reshards_after_forward]
        saved = [
            (
                s,
                internals.read(s, "auto_reshard_after_forward"),
                [internals.read(g, "post_forward_mesh_info") for g in state_groups(s)],
            )
            for s in states
        ]
        for u in units:
            if u.reshards_after_forward:
                as_fsdp2(u.module).set_reshard_after_forward(False, False)  # `recurse` is positional in torch 2.13

        def restore() -> None:
            for state, auto, infos in saved:
                internals.write(state, "auto_reshard_after_forward", auto)
                for group, info in zip(state_groups(state), infos, strict=True):
                    internals.write(group, "post_forward_mesh_info", info)

        return restore

    def reshard(self, units: Sequence[Unit]) -> None:
        for u in units:
            as_fsdp2(u.module).reshard()

    def reshard_left_gathered(self, optimizer: torch.optim.Optimizer) -> list[Unit]:
        # FSDP2 all-gathers in a forward only into a group that is sharded: one left unsharded (the
        # root after a forward with no backward; a windowed unit, kept
        # through it) would run the next forward on its parameters from before the step.
        left = [u for u in self.units if not u.resident and any(unsharded(g) for g in param_groups(u))]
        if not left:
            return []  # after every normal window: attribute reads only
        ours = {id(sharded_param(p)) for u in left for p in unit_params(as_fsdp2(u.module))}
        if not any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
            return []  # another model's optimizer (a GAN's): these are not stale
        self.reshard(left)
        return left

    def unit_modules(self) -> list[tuple[nn.Module, Unit]]:
        by_state = {id(as_fsdp2(u.module)._get_fsdp_state()): u for u in self.units}
        return [
            (m, by_state[id(m._get_fsdp_state())])
            for m in self.model.modules()
            if isinstance(m, FSDPModule) and id(m._get_fsdp_state()) in by_state
        ]

    def reshards_now(self, unit: Unit) -> bool:
        # No public getter for reshard_after_forward: read it where its setter writes it.
        groups = state_groups(as_fsdp2(unit.module)._get_fsdp_state())
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
