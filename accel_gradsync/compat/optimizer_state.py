"""An FSDP1 optimizer saved as a sharded state dict, loaded whole on resume.

accelerate's `load_fsdp_optimizer` builds FSDP1's load template from the unstepped optimizer of
the resumed run, so torch.distributed.checkpoint fills nothing and training goes on with a fresh
optimizer without a word. `OptimizerStateFix` loads it again right after accelerate did, with
torch's own helpers: `get_optimizer_state_dict` (a template with every entry), DCP with
`DefaultLoadPlanner(flatten_sharded_tensors=False)` (keeps the shards a rank does not hold), then
`set_optimizer_state_dict`. It runs as a load pre-hook of `Accelerator.load_state`, and for a
Trainer at train begin (`after_trainer_load`). FSDP2 and full state dicts need none of this.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate.utils.constants import OPTIMIZER_NAME
from torch import nn


def loads_through_template(accelerator: Accelerator) -> bool:
    """True where accelerate loads the optimizer through a template of its current state:
    FSDP1 with a sharded state dict."""
    from torch.distributed.fsdp import StateDictType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return (
        accelerator.distributed_type == DistributedType.FSDP
        and plugin is not None
        and plugin.fsdp_version == 1
        and plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    )


def checkpoint_holds_state(directory: str) -> bool:
    """True when accelerate's optimizer checkpoint `directory` (DCP) has per-parameter state."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return False  # none saved, or per-rank files (use_dcp=False), which load as a whole
    keys = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer.state.") for key in keys)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Load accelerate's sharded FSDP1 optimizer checkpoint `directory` into `optimizer`, every entry."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = _torch_optimizer(optimizer)
    if any(p.grad is not None for group in inner.param_groups for p in group["params"]):
        raise ValueError(
            "accel_gradsync: cannot restore this FSDP1 optimizer from its sharded checkpoint: it has "
            "not stepped and its parameters hold gradients, so torch cannot initialise the state to "
            "load into, and accelerate's load left it empty. Call optimizer.zero_grad(set_to_none=True) "
            "before loading the checkpoint."
        )
    template = {"optimizer": get_optimizer_state_dict(model, inner)}  # initialises the state first
    dcp.load(
        template,
        storage_reader=dcp.FileSystemReader(directory),
        planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
    )
    set_optimizer_state_dict(model, inner, template["optimizer"])
    assert inner.state, "a checkpoint with optimizer state loaded none"  # invariant of the load above


def trainer_checkpoint(trainer: Any) -> str | None:
    """The checkpoint a resumed Trainer loaded: `args.resume_from_checkpoint`, or the one
    `train(resume_from_checkpoint=True)` picks, `<output_dir>/checkpoint-<global_step>`; only a
    directory whose `trainer_state.json` is the state the Trainer resumed with."""
    state, args = trainer.state, trainer.args
    for directory in (args.resume_from_checkpoint, os.path.join(args.output_dir, f"checkpoint-{state.global_step}")):
        path = os.path.join(directory, "trainer_state.json") if isinstance(directory, str) else ""
        if os.path.isfile(path):
            with open(path) as f:
                saved = json.load(f)
            if saved.get("global_step") == state.global_step and saved.get("log_history") == state.log_history:
                return directory
    return None


class OptimizerStateFix:
    """The hooks of one `attach()` that reload an FSDP1 sharded optimizer accelerate left empty."""

    def __init__(self, accelerator: Accelerator, trainer: Any = None) -> None:
        self.accelerator = accelerator
        self.trainer = trainer

    def on_load_state(self, models: list, input_dir: str) -> None:
        """accelerate's load pre-hook, which runs after it loaded the optimizers."""
        accelerator = self.accelerator
        if not loads_through_template(accelerator):
            return
        for index, optimizer in enumerate(accelerator._optimizers):
            directory = os.path.join(input_dir, f"{OPTIMIZER_NAME}_{index}")
            if not _torch_optimizer(optimizer).state and checkpoint_holds_state(directory):
                # accelerate pairs optimizer i with model i the same way.
                load_optimizer_state(accelerator._models[index], optimizer, directory)

    def after_trainer_load(self) -> None:
        """At train begin, once a resuming Trainer has loaded its checkpoint."""
        trainer = self.trainer
        if trainer is None or trainer.state.global_step == 0 or not loads_through_template(self.accelerator):
            return
        optimizer, model = trainer.optimizer, trainer.model_wrapped
        if optimizer is None or _torch_optimizer(optimizer).state:
            return
        checkpoint = trainer_checkpoint(trainer)
        if checkpoint is not None:
            directory = os.path.join(checkpoint, f"{OPTIMIZER_NAME}_0")
            if checkpoint_holds_state(directory):
                load_optimizer_state(model, optimizer, directory)
            return
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(model, _torch_optimizer(optimizer))  # a stateless optimizer stays empty
        if _torch_optimizer(optimizer).state:
            raise ValueError(
                f"accel_gradsync: the Trainer resumed at step {trainer.state.global_step} with FSDP1 and "
                "fsdp_state_dict_type SHARDED_STATE_DICT, where accelerate loads the optimizer without its "
                "state, and the checkpoint to load it from again is not known. Pass the checkpoint "
                "directory as TrainingArguments.resume_from_checkpoint (--resume_from_checkpoint) too, or "
                "save with fsdp_state_dict_type FULL_STATE_DICT."
            )


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (whose `step` skips
    unsynced micro-batches)."""
    return getattr(optimizer, "optimizer", optimizer)
