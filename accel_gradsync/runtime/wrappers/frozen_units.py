"""`keep_frozen_unsharded`: the frozen base of a trained model (LoRA) gathered once per run, only
the trainable parameters (the adapters) after each optimizer step.

FSDP2 all-gathers a unit's parameters together, frozen and trained alike, so keeping a decoder
layer unsharded across optimizer steps would keep its adapters stale. Of the two exact ways
(gather only the trainable parameters' new shards into FSDP2's unsharded storage, or give the
trainable parameters units of their own), this takes the second: it is FSDP2's own machinery
through `fully_shard` and its public setters, where the first would write FSDP2's private
unsharded storage on every step of every torch series. `split_trainable` runs inside
`accelerator.prepare` (hooks.py), before accelerate shards the model: within each module its
auto-wrap policy will make a unit (a decoder layer), the modules whose own parameters are all
trainable (LoRA's `lora_A`/`lora_B` Linears) become one FSDP2 unit, with the mesh, mixed
precision, offload and `reshard_after_forward` accelerate will give the layer; accelerate then
skips them and the layer's unit holds only frozen parameters. An optimizer built before, passed to
the same or a later `prepare`, gets the new parameters by name. `FrozenResidency.keep` then sets
`reshard_after_forward` and `reshard_after_backward` off on every unit left with no trainable
parameter, so FSDP2 gathers it at its first forward and never again; the adapter units reshard as
usual and are gathered each step.

Cost: every kept unit's whole unsharded parameters (compute dtype) on every rank for the run.
Between steps a kept unit's parameters are plain tensors, not DTensors: code that works on the
sharded model there (PEFT's `merge_adapter`, which adds DTensors into the base, and reading
`full_tensor()` for a weight sync) calls `reshard()` first (`grad_sync.reshard_frozen()`), and the
next forward gathers the kept units again.
Refused where it cannot work: a model prepared before attach (accelerate has sharded it), and
`fsdp_cpu_ram_efficient_loading` (accelerate moves the model to meta and reloads its state dict,
which would then hold the adapters' shards, not their full tensors). A state-dict save or load
reshards the kept units (FSDP2's own hooks): the next forward gathers them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.config.settings import ResolvedConfig
from accel_gradsync.planning.residency import frozen_units_to_keep
from accel_gradsync.runtime.wrappers.fsdp2_state import param_now, sharded_param, unit_params


def applies(accelerator: Accelerator) -> bool:
    """FSDP2 under accelerate: where the setting does anything."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return False  # NOTE: accelerate's state raises on `fsdp_plugin` when it has none
    return getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 1) == 2


def split_trainable(
    accelerator: Accelerator, model: nn.Module, worth: Callable[[list[int]], bool] = lambda sizes: True
) -> dict[int, nn.Parameter]:
    """Before accelerate shards `model`: one FSDP2 unit for the trainable modules inside each
    module its auto-wrap policy will shard, where `worth` says the frozen units that leaves
    (their unsharded bytes, in model order) are worth it: some would be kept. Returns the
    parameters replaced, by the id of the old one (for the optimizers built before)."""
    plugin = accelerator.state.fsdp_plugin
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return {}  # sharded already (a model prepared again): nothing to split
    if not any(p.requires_grad for p in model.parameters()) or all(p.requires_grad for p in model.parameters()):
        return {}  # nothing frozen beside something trained (a reference model, full fine-tuning)
    plugin.set_auto_wrap_policy(model)  # what accelerate's fsdp2_prepare_model does first
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    layers = [m for m in get_module_children_bottom_up(model)[:-1] if policy is not None and policy(m)]
    splits = [(layer, leaves) for layer in layers if (leaves := _trainable_leaves(layer))]
    splits = [(layer, leaves) for layer, leaves in splits if any(not p.requires_grad for p in layer.parameters())]
    dtype = getattr(plugin.mixed_precision_policy, "param_dtype", None)  # what FSDP2 will gather them in
    sizes = [sum(p.numel() * (dtype or p.dtype).itemsize for p in layer.parameters() if not p.requires_grad)
             for layer, _ in splits]  # fmt: skip
    if not splits or not worth(sizes):
        return {}  # nothing to split, or no frozen layer would be kept: more, smaller all-gathers for nothing
    if plugin.cpu_ram_efficient_loading:
        raise ValueError(
            "keep_frozen_unsharded (true, or auto under budget or auto) with fsdp_cpu_ram_efficient_loading=true: "
            "accelerate reloads the model's state dict after sharding, which would hold the adapters' shards "
            "instead of their tensors; set fsdp_cpu_ram_efficient_loading: false in the accelerate config, or "
            "keep_frozen_unsharded=false."
        )
    before = dict(model.named_parameters())
    mesh = accelerator.torch_device_mesh
    kwargs: dict[str, Any] = {
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": plugin.cpu_offload,
        "reshard_after_forward": plugin.reshard_after_forward,
    }
    for _, leaves in splits:  # bottom-up, as accelerate shards: no layer inside another is split twice
        if not any(isinstance(m, FSDPModule) for m in leaves):
            fully_shard(leaves, **kwargs)
    after = dict(model.named_parameters())
    return {id(p): after[name] for name, p in before.items() if after[name] is not p}


def switch_optimizer_params(optimizer: Any, replaced: dict[int, nn.Parameter]) -> None:
    """An optimizer built before `split_trainable`: its parameters that were replaced, by the new
    ones (before accelerate maps them to their shards, as it does the others')."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not any(id(p) in replaced for g in inner.param_groups for p in g["params"]):
        return
    if inner.state:
        raise ValueError(
            "keep_frozen_unsharded: the optimizer passed to accelerator.prepare() has already stepped; "
            "prepare the model and the optimizer before the first step."
        )
    for group in inner.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]


class FrozenResidency:
    """The units of one `attach()` kept unsharded for the run, with the flags they had."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[FSDPModule, bool]] = {}  # by unit state: (its module, reshard_after_forward)
        self.replaced: dict[int, nn.Parameter] = {}  # split_trainable's, for optimizers prepared later

    def split(
        self,
        accelerator: Accelerator,
        objects: tuple,
        settings: ResolvedConfig,
        free_memory: Callable[[], int],
        taken: int,
    ) -> None:
        """In `accelerator.prepare(*objects)`, before accelerate: split each model where some frozen
        layer would be kept (`frozen_units_to_keep` over the layers' frozen bytes), switch each
        optimizer's parameters (this call's or, where it comes later, a later one's)."""

        def worth(sizes: list[int]) -> bool:
            return any(frozen_units_to_keep(settings, sizes, free_memory, taken))

        for obj in objects:
            if isinstance(obj, nn.Module):
                self.replaced.update(split_trainable(accelerator, obj, worth))
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "param_groups"):
                switch_optimizer_params(obj, self.replaced)

    def keep(self, model: nn.Module, settings: ResolvedConfig, free_memory: Callable[[], int], taken: int) -> None:
        """The FSDP2 units of the prepared `model` with no trainable parameter that
        `keep_frozen_unsharded` keeps (planning/residency.py: all, or those that fit): never
        resharded. `taken`: what resident reference models keep already."""
        frozen, seen = [], set()
        for module in model.modules():
            if not isinstance(module, FSDPModule) or id(module._get_fsdp_state()) in seen:
                continue
            seen.add(id(module._get_fsdp_state()))
            params = unit_params(module)
            if params and not any(param_now(p).requires_grad for p in params):
                frozen.append((module, sum(_unsharded_bytes(p) for p in params)))
        chosen = frozen_units_to_keep(settings, [size for _, size in frozen], free_memory, taken)
        for (module, _), keep in zip(frozen, chosen, strict=True):
            if keep and id(module._get_fsdp_state()) not in self._kept:
                self._kept[id(module._get_fsdp_state())] = (module, _reshards_after_forward(module))
                module.set_reshard_after_forward(False, False)  # `recurse` is positional in torch 2.13
                module.set_reshard_after_backward(False, recurse=False)

    def review(self, model: nn.Module) -> None:
        """`model`'s trainable parameters changed (progressive unfreezing): a kept unit given one
        reshards as before from now on (its kept copy would go stale at the optimizer step)."""
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            key = id(module._get_fsdp_state())
            if key in self._kept and any(param_now(p).requires_grad for p in unit_params(module)):
                self._give_back(key)

    def reshard(self) -> None:
        """Every kept unit resharded (FSDP2's `reshard()`: nothing for one sharded already), its
        flags kept: the next forward all-gathers it again and keeps it."""
        for module, _ in self._kept.values():
            module.reshard()

    def release(self) -> None:
        """Detach: every kept unit's flags back, resharded."""
        for key in list(self._kept):
            self._give_back(key)

    def _give_back(self, key: int) -> None:
        module, reshards = self._kept.pop(key)
        module.set_reshard_after_forward(reshards, False)
        module.set_reshard_after_backward(True, recurse=False)
        module.reshard()


def _trainable_leaves(layer: nn.Module) -> list[nn.Module]:
    """The modules under `layer` whose own parameters are all trainable (LoRA's Linears), outermost
    first, none inside another."""
    found: list[nn.Module] = []
    for module in layer.modules():
        if module is layer or any(module in set(f.modules()) for f in found):
            continue
        own = list(module.parameters(recurse=False))
        if own and all(p.requires_grad for p in own) and all(p.requires_grad for p in module.parameters()):
            found.append(module)
    return found


def _unsharded_bytes(p: Any) -> int:
    """One FSDPParam's unsharded bytes in the dtype FSDP2 gathers it in (its `param_dtype`)."""
    dtype = internals.read(p, "mp_policy").param_dtype or sharded_param(p).dtype
    return sharded_param(p).numel() * dtype.itemsize


def _reshards_after_forward(module: FSDPModule) -> bool:
    """What `set_reshard_after_forward` last set (the root: False, FSDP2's choice for it)."""
    groups = internals.read(module._get_fsdp_state(), "param_groups")
    return all(internals.read(g, "post_forward_mesh_info") is not None for g in groups)
