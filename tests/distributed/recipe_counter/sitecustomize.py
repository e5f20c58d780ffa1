"""Counts a launched run's real collectives from outside the script under test.

A test puts this folder on PYTHONPATH and names an output folder in RECIPE_COUNTER_DIR; every
rank that `accelerate launch` starts (it has RANK set) then wraps the torch.distributed
collectives FSDP calls and `torch.utils.checkpoint.checkpoint` (activation checkpointing), notes
which FSDP wrappers exist when the first gradient reduce-scatter runs, and writes `rank<R>.json`
at exit. Other processes (the launcher itself) are untouched.
"""

import os

if os.environ.get("RECIPE_COUNTER_DIR") and "RANK" in os.environ:
    import atexit
    import gc
    import json
    from collections import Counter

    import torch.distributed as dist

    _COUNTED = (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_gather_single",
        "all_gather_into_tensor",
    )
    _counts: Counter = Counter()
    _by_group: Counter = Counter()
    _wrapping: dict = {}

    def _fsdp_units() -> dict:
        """The FSDP wrappers alive right now, and the gradient-reducing groups behind them: FSDP2
        param groups (several modules can share one, when `fully_shard` was given a list) and
        FSDP1 flat parameters, each counted once and only with trainable parameters."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.nn.parallel import DistributedDataParallel

        objects = gc.get_objects()
        fsdp2 = [o for o in objects if isinstance(o, FSDPModule)]
        fsdp1 = [o for o in objects if isinstance(o, FSDP1) and getattr(o, "_handle", None) is not None]
        groups = {
            id(g): g
            for m in fsdp2
            for g in m._get_fsdp_state()._fsdp_param_groups
            if any(p.sharded_param.requires_grad for p in g.fsdp_params)
        }
        return {
            "fsdp2_modules": sorted(type(o).__name__ for o in fsdp2),
            "fsdp2_reducing_groups": len(groups),
            "fsdp1_modules": sorted(type(o.module).__name__ for o in fsdp1),
            "fsdp1_reducing_groups": sum(o._handle.flat_param.requires_grad for o in fsdp1),
            "ddp_modules": sum(isinstance(o, DistributedDataParallel) for o in objects),
        }

    def _wrap(name: str) -> None:
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            _counts[name] += 1
            if name == "all_reduce":  # and over which ranks: a multi-host test tells cross-host ones apart
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                _by_group[",".join(map(str, dist.get_process_group_ranks(group or dist.group.WORLD)))] += 1
            if name.startswith("reduce_scatter") and not _wrapping:
                _wrapping.update(_fsdp_units())
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    for _name in _COUNTED:
        _wrap(_name)

    import torch.utils.checkpoint as _checkpoint

    _recompute = _checkpoint.checkpoint

    def _checkpointed(*args, **kwargs):
        """A call that activation checkpointing (transformers' included) will recompute in backward."""
        _counts["activation_checkpoint"] += 1
        return _recompute(*args, **kwargs)

    _checkpoint.checkpoint = _checkpointed

    @atexit.register
    def _dump() -> None:
        out = {"counts": dict(_counts), "all_reduces_by_group": dict(_by_group), **_wrapping}
        path = os.path.join(os.environ["RECIPE_COUNTER_DIR"], f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(out, f)
