"""What changed, within the ranges setup.cfg allows, in the transformers, accelerate and TRL APIs
this package and recipes/grpo.py use, each with the release that changed it. Callers ask here
instead of comparing versions themselves; an entry goes when the floor in setup.cfg passes its
release.

transformers (setup.cfg allows 5.17 on):
- 5.23 renamed `TrainingArguments.gradient_checkpointing` (and `_kwargs`) to
  `activation_checkpointing` (`_kwargs`), keeping the old names as deprecated aliases
  (`training_arg`); the model methods moved with them (`activation_checkpointing_enable`,
  `is_activation_checkpointing`: `estimator/step_peak.py` and `estimator/forecast/live.py` try the new
  name, then the old one).
- 5.23 added `Trainer._defer_fsdp_gradient_reduction`, through which the Trainer defers a model
  it sharded at load time (`DistributedConfig`); `runtime/integration/hooks.py` refuses such a model on an
  older release, which cannot shard at load time the way 5.23 does.
- 5.24 renamed a model's KV cache argument and output field `past_key_values` to `cache`
  (`kv_cache_name`).

accelerate (1.13 on) and TRL (1.16 on): nothing this package uses differs. Before 1.13,
accelerate's `load_state` loaded an FSDP2 optimizer into its unstepped `state_dict()`, so a
resumed run went on with an empty optimizer: setup.cfg starts at 1.13 instead of shimming it.
"""

from __future__ import annotations

import dataclasses

import transformers
from packaging.version import Version

TRAINER_DEFER = "_defer_fsdp_gradient_reduction"
"""The Trainer method that defers a load-time-sharded model's gradient sync (transformers 5.23 on)."""
TRAINER_DEFER_SINCE = "5.23"

_RENAMED_TRAINING_ARGS = {  # today's name: the name before transformers 5.23
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


def transformers_at_least(release: str, version: str = transformers.__version__) -> bool:
    """True when transformers `version` is `release` or later (a `.dev0` of it counts)."""
    return Version(version).release >= Version(release).release


def training_arg(name: str) -> str:
    """The `TrainingArguments` field the installed transformers has for `name` (today's name):
    the pre-5.23 one where it has only that."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return name if name in fields else _RENAMED_TRAINING_ARGS.get(name, name)


def kv_cache_name(version: str = transformers.__version__) -> str:
    """A model's KV cache argument and output field: `cache` from transformers 5.24, else
    `past_key_values`."""
    return "cache" if transformers_at_least("5.24", version) else "past_key_values"
