"""Shard a meta-device model as `Accelerator.prepare` (or transformers' `from_pretrained`, or TRL's
`prepare_fsdp` for a reference model) would, by running those libraries' own sharding code inside
`fake_world`: a fake process group of the planned world size whose collectives do nothing. Only
what accelerate keeps inline in `prepare_model` is written out here (each function says what). The
mesh is a CPU mesh whatever the machine has: a unit's sizes and dtypes do not depend on the device
type, and the estimate should not touch a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from accel_gradsync.config.settings import ResolvedConfig

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class KeepFrozen:
    """`keep_frozen_unsharded` as a live `accelerator.prepare` applies it (runtime/integration/hooks.py): the
    settings of one sync mode, free memory per rank (read only where that mode decides from it)
    and what resident reference models keep already; `FrozenResidency.split` before accelerate
    shards, `FrozenResidency.keep` after."""

    settings: ResolvedConfig
    free_memory: Callable[[], int]
    taken: int = 0


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A default process group of `world_size` ranks (this process is rank 0) whose collectives do
    nothing, for the block; destroyed on exit, so a real one can be initialised later in the same
    process. A process that already has one is refused: the fake world would replace its group."""
    if dist.is_initialized():
        raise ValueError(
            "the estimate shards the model in a fake process group of the planned world size, and this "
            "process already has a torch.distributed process group; run `accel-gradsync estimate` in its "
            "own process, or call estimate() before init_process_group."
        )
    excepthook = sys.excepthook  # init_process_group replaces it for good (a "[rank0]:" prefix)
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@dataclass
class _PreparingAccelerator:
    """What `accelerate.utils.fsdp2_prepare_model` reads of an `Accelerator`: a real one would
    initialise accelerate's process-wide state and need the launch environment."""

    fsdp_plugin: Any
    torch_device_mesh: Any
    parallelism_config: Any
    mixed_precision: str
    is_main_process: bool = False  # accelerate's logger needs its process-wide state: log nothing
    device: torch.device = torch.device("meta")
    state: Any = field(init=False)

    def __post_init__(self) -> None:
        self.state = SimpleNamespace(fsdp_plugin=self.fsdp_plugin)


def shard_like_accelerate(
    model: nn.Module,
    plugin: Any,
    mixed_precision: str,
    replicate_size: int,
    shard_size: int,
    keep: KeepFrozen | None = None,
    split: bool = False,
) -> nn.Module:
    """`model` (on the meta device) wrapped as `Accelerator.prepare` wraps it with `plugin` (an
    `accelerate.utils.FullyShardedDataParallelPlugin` whose mixed precision is already set), on
    a `replicate_size` x `shard_size` mesh (FSDP2; FSDP1 shards over the whole world). Must run
    inside `fake_world`; the model is modified in place.

    FSDP2: accelerate's own `fsdp2_prepare_model` (its wrap policy, its carving of the input
    embedding and of the [final norm, lm_head] group, its root call, its fp32 upcast) calls
    `fully_shard` on the meta-device model; the DTensor shards stay on the meta device. With
    `keep`, the runtime's own `FrozenResidency` splits the trainable modules off before and keeps
    the frozen units after, as `keep_frozen_unsharded` makes the live prepare do, with the same
    accelerator-like object accelerate reads; with `split`, only `split_trainable`, whatever
    would be kept."""
    if plugin.fsdp_version != 2:
        return _shard_fsdp1(model, plugin, mixed_precision)
    from accelerate import ParallelismConfig
    from accelerate.utils import fsdp2_prepare_model

    from accel_gradsync.runtime.wrappers.frozen_units import FrozenResidency, split_trainable

    # Always accelerate's mesh for a parallelism_config, also for a config without one (where a
    # launch lets fully_shard build its default 1-D mesh over the world: the same shards, but on
    # the GPU where there is one).
    parallelism = ParallelismConfig(dp_replicate_size=replicate_size, dp_shard_size=shard_size)
    mesh = parallelism.build_device_mesh("cpu")
    accelerator = _PreparingAccelerator(plugin, mesh, parallelism, mixed_precision)
    try:
        with warnings.catch_warnings():
            # accelerate slices its own flattened mesh (a launched run warns the same); not the user's to fix.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            residency = FrozenResidency()
            live = cast(Any, accelerator)  # what split_trainable reads of an Accelerator, as accelerate's does
            if keep is not None:
                residency.split(live, (model,), keep.settings, keep.free_memory, keep.taken)
            elif split:
                split_trainable(live, model)
            wrapped = fsdp2_prepare_model(accelerator, model)
            if keep is not None:
                residency.keep(wrapped, keep.settings, keep.free_memory, keep.taken)
            return wrapped
    except AttributeError as err:
        if not isinstance(getattr(err, "obj", None), (_PreparingAccelerator, SimpleNamespace)):
            raise
        raise RuntimeError(
            f"accelerate's fsdp2_prepare_model reads more of the Accelerator than the estimate gives it ({err}); "
            "this accelerate release is newer than accel_gradsync knows (see constraints.txt)."
        ) from err


def shard_like_trl(
    model: nn.Module, plugin: Any, mixed_precision: str, replicate_size: int, shard_size: int
) -> nn.Module:
    """A reference model (on the meta device) sharded as TRL shards it for GRPO's `beta` > 0: TRL's
    own `trl.models.utils.prepare_fsdp` with accelerate's `plugin` (FSDP2: one `fully_shard` at the
    root, the plugin's reshard_after_forward and mixed precision, accelerate's FSDP mesh). Must run
    inside `fake_world`; the model is modified in place."""
    try:
        from trl.models.utils import prepare_fsdp
    except ImportError:
        raise ValueError(
            "--beta: the reference model is sharded with TRL's own prepare_fsdp; pip install trl (the "
            "recipes extra), or leave --beta out."
        ) from None
    from accelerate import ParallelismConfig

    parallelism = ParallelismConfig(dp_replicate_size=replicate_size, dp_shard_size=shard_size)
    accelerator = _PreparingAccelerator(plugin, parallelism.build_device_mesh("cpu"), parallelism, mixed_precision)
    with warnings.catch_warnings():
        # TRL slices accelerate's flattened mesh (a launched run warns the same); not the user's to fix.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        prepare_fsdp(model, accelerator)  # FSDP2 shards `model` in place (FSDP1 is not estimated: reference.py)
    return model


def _shard_fsdp1(model: nn.Module, plugin: Any, mixed_precision: str) -> nn.Module:
    """`FullyShardedDataParallel` with the plugin's wrap policy and the keyword arguments
    `Accelerator.prepare_model` passes (written out: accelerate keeps them inline there). FSDP1
    cannot keep parameters on the meta device (their device must match its compute device), so,
    as accelerate does for a meta model, `param_init_fn` materialises each module, here as fake
    tensors (shapes and dtypes, no storage); `ensure_weights_retied` keeps tied weights tied."""
    from accelerate.utils import ensure_weights_retied
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FullyShardedDataParallel

    if mixed_precision != "no":
        # accelerate upcasts FSDP1's flat parameters to fp32 after wrapping; upcasting the
        # originals before gives the same flat parameters.
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)

    def materialise(module: nn.Module) -> nn.Module:
        return module.to_empty(device=_CPU, recurse=False)

    with FakeTensorMode(allow_non_fake_inputs=True):
        return FullyShardedDataParallel(
            model,
            sharding_strategy=plugin.sharding_strategy or plugin.reshard_after_forward,
            auto_wrap_policy=plugin.auto_wrap_policy,
            mixed_precision=plugin.mixed_precision_policy,
            use_orig_params=plugin.use_orig_params,
            limit_all_gathers=plugin.limit_all_gathers,
            param_init_fn=ensure_weights_retied(materialise, model, _CPU),
            device_id=_CPU,
        )


def shard_like_transformers(model: nn.Module, distributed_config: dict) -> nn.Module:
    """`model` (on the meta device) sharded as `from_pretrained(..., distributed_config=...)`
    shards it: `prepare_distribute_model` and `maybe_distribute_model`, the two steps
    `from_pretrained` runs, build transformers' own mesh and shard its `fsdp_plan`. Must run inside
    `fake_world`."""
    from transformers.distributed import DistributedConfig

    cls: Any = type(model)  # a transformers PreTrainedModel: the two steps are its classmethods
    config, _, mesh = cls.prepare_distribute_model(DistributedConfig(**distributed_config))
    return cls.maybe_distribute_model(model, config, mesh)
