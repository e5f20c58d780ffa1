"""One optimizer step on fake tensors, as torch's `FSDPMemTracker` sees it (`FakeStep`): the peak
bytes per rank of each phase of a step, for one model config and one `Schedule`.

The model is built on the meta device and sharded by accelerate's own code (fake_shard.py) in a
fake process group of the launch's world size, then materialised as fake tensors (shapes and
dtypes, no storage) inside the tracker: optimizer state created as a step leaves it, then
min(M, 2) micro-batches of forward+backward with the schedule's FSDP2 flags (held units skip the
sync of the non-final micro-batch, windowed units stay unsharded, as runtime/wrappers/fsdp2.py sets them),
then the optimizer step; the tracker's peak is read per phase. GRPO's generation is a run of its
own: the prompt prefilled, then the last token decoded with the KV cache at its largest (a decode's
peak grows with the cache, so the last token's is the decode's). step_peak.py decides which
schedules to run and for how many layers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from accel_gradsync.compat.releases import kv_cache_name
from accel_gradsync.config.settings import GradSyncConfig
from accel_gradsync.estimator.fake_shard import fake_world, shard_like_accelerate
from accel_gradsync.estimator.inputs import FSDPSetup, LoraSpec, StepShape
from accel_gradsync.estimator.meta_model import build_accelerate_plugin, build_meta_model
from accel_gradsync.planning.units import GRADIENT_SYNC
from accel_gradsync.runtime.wrappers.adapt import adapt_model
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter

PHASES = ("first_micro_batch", "later_micro_batch", "optimizer_step")
_INDEXED = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True)
class Schedule:
    """What one simulated step holds, by unit key (a unit's name with a trailing layer index as
    `*`, so it names the same units in the model with fewer layers): the units whose sync the
    non-final micro-batches skip (`held_sync`: `gradient_sync`, or on HSDP only the `all_reduce`),
    and the windowed units whose params stay unsharded from the window's first forward to its last
    backward (runtime/wrappers/fsdp2.py's `hold` and `keep_params_through_forward`)."""

    mode: str
    held: frozenset[str] = frozenset()
    windowed: frozenset[str] = frozenset()
    held_sync: str = GRADIENT_SYNC
    resident: frozenset[str] = frozenset()
    """Frozen units `keep_frozen_unsharded` keeps unsharded for the run: where any, the model's
    trainable modules are split into units of their own first, as a live prepare splits them
    (`split_trainable`), and these never reshard (as `FrozenResidency.keep` sets them)."""


@dataclass
class SimulatedStep:
    """One simulated step's peaks per phase (bytes per rank) and, at the later (else the first)
    micro-batch's peak, the tracker's categories."""

    phases: dict[str, int]
    sharded_params: int
    optimizer_state: int
    activations: int
    """Everything else live at that peak: activations, temporaries, inputs, unsharded params and
    gradients, all-gather and reduce-scatter buffers."""


def unit_key(name: str) -> str:
    """`model.layers.7` -> `model.layers.*`, and a unit inside a layer (LoRA's adapters, split by
    `keep_frozen_unsharded`) `model.layers.7.self_attn.q_proj.lora_A.default` ->
    `model.layers.*.self_attn.q_proj.lora_A.default`; other names as they are."""
    return _INDEXED.sub(".*", name)


class FakeStep:
    """Runs one launch's steps on fake tensors: `run` a training step of a schedule, `generate`
    GRPO's generation, each for the model config it is given (the whole model's, or one with
    fewer layers). A failure of torch's fake tensors or tracker is the one-line `ValueError` the
    CLI prints."""

    def __init__(
        self,
        model_dtype: torch.dtype,
        setup: FSDPSetup,
        config: GradSyncConfig,
        shape: StepShape,
        micro_batches: int,
        lora: LoraSpec | None = None,
    ) -> None:
        self.model_dtype, self.setup, self.config = model_dtype, setup, config
        self.shape, self.micro_batches, self.lora = shape, micro_batches, lora

    def run(self, model_config: Any, schedule: Schedule, whole: bool) -> SimulatedStep:
        """`schedule`'s training step for `model_config`; `whole`: the schedule names units by
        name, else by unit key (`unit_key`: the model has fewer layers than the run's)."""
        return self._explain(model_config, lambda: self._run(model_config, schedule, whole))

    def generate(self, model_config: Any, gathered: bool) -> int:
        """The generation phase's peak for `model_config`, units kept gathered or not."""
        return self._explain(model_config, lambda: self._generate(model_config, gathered))

    def _explain(self, model_config: Any, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except (RuntimeError, NotImplementedError, TypeError, AssertionError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(
                f"--micro-batch-size/--seq-len: the step forecast could not run {model_config.model_type} on fake "
                f"tensors ({type(err).__name__}: {first}); drop the two flags for the estimate without it."
            ) from None

    @contextlib.contextmanager
    def _tracked_model(
        self, model_config: Any, mode: str, checkpointing: bool, split: bool = False
    ) -> Iterator[tuple[torch.nn.Module, ModelAdapter, torch.optim.Optimizer, Any]]:
        """`model_config`'s model sharded as accelerate shards it for `mode` (with `split`, its
        trainable modules in units of their own first, as `keep_frozen_unsharded` splits them), on
        fake tensors in a fake world, with the optimizer state a step after the first holds,
        inside `FSDPMemTracker`."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        setup = self.setup
        with fake_world(setup.num_processes):
            model = build_meta_model(model_config, self.model_dtype, self.lora)
            head = getattr(model, "get_output_embeddings", None)
            if head is None or head() is None:
                raise ValueError(
                    f"--model: {type(model).__name__} is not a causal LM; the step forecast runs a causal-LM "
                    "forward with labels. Pass a causal-LM config, or drop --micro-batch-size/--seq-len."
                )
            if checkpointing:
                enable_checkpointing(model)
            model.train()
            plugin = build_accelerate_plugin(setup, self.config, model, mode)
            shards = (setup.mixed_precision, setup.replicate_size, setup.shard_size)
            model = shard_like_accelerate(model, plugin, *shards, split=split)
            adapter = adapt_model(model)
            assert adapter is not None  # fully_shard wrapped the root
            with FakeTensorMode(allow_non_fake_inputs=True):
                model.to_empty(device="cpu")
                params = [p for p in model.parameters() if p.requires_grad]
                optimizer = _build_optimizer(self.shape.optimizer, params)
                tracker = FSDPMemTracker(model, optimizer)
                with tracker:
                    for p in params:  # the state a step after the first holds (AdamW: both moments)
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                yield model, adapter, optimizer, tracker

    def _generate(self, model_config: Any, gathered: bool) -> int:
        """GRPO's generation on the fake model: one rank's generation batch, prompt prefilled with
        only the last position's logits, then tokens decoded one at a time with the KV cache, as
        transformers' `generate` decodes (TRL turns gradient checkpointing off for it); with
        `gathered`, every unit stays unsharded from its first forward on, as
        `gather_for_generation` keeps it. The larger of the prefill's peak and the last token's:
        the tokens before it are one forward that grows the cache, its own peak left out (the same
        bytes as decoding each, in three forwards where that takes one per token)."""
        shape = self.shape
        batch, prompt = shape.generation_batch(self.micro_batches), shape.seq_len - shape.max_completion_length
        with self._tracked_model(model_config, self.config.mode, checkpointing=False) as (model, adapter, _, tracker):
            if gathered:
                for unit in adapter.units:
                    cast(FSDPModule, unit.module).set_reshard_after_forward(False, recurse=False)
            kv = kv_cache_name()  # `cache` from transformers 5.24, `past_key_values` before
            decoded = shape.max_completion_length - 1  # tokens decoded after the prefill's first
            with torch.no_grad():
                with tracker:
                    ids = torch.randint(0, model_config.vocab_size, (batch, prompt))
                    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                    peak = _total(tracker.get_tracker_snapshot("peak"))
                    if decoded > 1:  # NOTE: grown in one forward, whose own peak is not a decode's
                        tracker.reset_mod_stats()  # the root's next forward (a PEFT root refuses it)
                        ids = torch.randint(0, model_config.vocab_size, (batch, decoded - 1))
                        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kv: getattr(out, kv)})
                    del ids
                if decoded > 0:  # the last token's decode, the largest cache: the decode's peak
                    tracker.reset_mod_stats()
                    with tracker:  # entering again starts the peak from what is live now
                        token = torch.softmax(out.logits[:, -1, :].float(), dim=-1).argmax(-1, keepdim=True)
                        cache = getattr(out, kv)
                        del out
                        out = model(input_ids=token, use_cache=True, **{kv: cache})
                        del out, cache
                        peak = max(peak, _total(tracker.get_tracker_snapshot("peak")))
                return peak

    def _run(self, model_config: Any, schedule: Schedule, whole: bool) -> SimulatedStep:
        """The tracked fake step of the module docstring, for `model_config` as given."""
        shape = self.shape
        split = bool(schedule.resident)
        tracked = self._tracked_model(model_config, schedule.mode, shape.gradient_checkpointing, split)
        with tracked as (model, adapter, optimizer, tracker):
            name = (lambda n: n) if whole else unit_key
            held = [cast(FSDPModule, u.module) for u in adapter.units if name(u.name) in schedule.held]
            resident = [cast(FSDPModule, u.module) for u in adapter.units if name(u.name) in schedule.resident]
            # A kept unit's flags stay as keep set them: the window's restore gives them back (fsdp2.py's `hold`).
            windowed = [
                cast(FSDPModule, u.module)
                for u in adapter.units
                if name(u.name) in schedule.windowed and name(u.name) not in schedule.resident
            ]
            for module in resident:  # never resharded, as FrozenResidency.keep sets them
                module.set_reshard_after_forward(False, False)  # `recurse` is positional in torch 2.13
                module.set_reshard_after_backward(False, recurse=False)
            phases: dict[str, int] = {}
            count = min(self.micro_batches, 2)  # micro-batches after the second repeat the second
            for k, phase in enumerate(PHASES[:count] if count == 2 else PHASES[:1]):
                last = k == count - 1
                for module in held:
                    if schedule.held_sync == GRADIENT_SYNC:
                        module.set_requires_gradient_sync(last, recurse=False)
                    else:
                        module.set_requires_all_reduce(last, recurse=False)
                for module in windowed:
                    module.set_reshard_after_forward(False, False)
                    module.set_reshard_after_backward(last, recurse=False)
                tracker.reset_mod_stats()  # per-module stats refuse a second iteration; the peak is kept
                with tracker:  # entering again starts the peak from what is live now
                    ids = torch.randint(0, model_config.vocab_size, (shape.micro_batch_size, shape.seq_len))
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    del ids
                    phases[phase] = _total(tracker.get_tracker_snapshot("peak"))
                    snapshot = tracker.get_tracker_snapshot("peak")
            with tracker:
                optimizer.step()
                phases["optimizer_step"] = _total(tracker.get_tracker_snapshot("peak"))
                optimizer.zero_grad(set_to_none=True)
        persistent = ("Sharded Param", "OptState", "Sharded Grad", "Buffer")
        return SimulatedStep(
            phases=phases,
            sharded_params=_category(snapshot, "Sharded Param"),
            optimizer_state=_category(snapshot, "OptState"),
            activations=_total(snapshot) - sum(_category(snapshot, c) for c in persistent),
        )


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, as a run would switch it on
    (`activation_checkpointing_enable`; before transformers 5.x `gradient_checkpointing_enable`)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        legacy: Any = model
        legacy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _build_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3)


def _total(snapshot: dict) -> int:
    return max((int(dev.get("Total", 0)) for dev in snapshot.values()), default=0)


def _category(snapshot: dict, name: str) -> int:
    values = (int(v) for dev in snapshot.values() for k, v in dev.items() if getattr(k, "value", k) == name)
    return max(values, default=0)
