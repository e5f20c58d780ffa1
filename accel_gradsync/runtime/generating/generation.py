"""Forwards without gradients (generation, no-grad log-prob passes, evaluation): with
`gather_for_generation` (or inside `gathered()`) each FSDP2 unit all-gathers once and stays
unsharded until training resumes, instead of once per forward (per generated token). A frozen
model's units (a reference model, `FrozenModel.keeps`: by default where it is one unit) do the
same without the setting: its log-prob pass gathers it once per step instead of once per forward.
A resident one (`FrozenModel.resident`) is not released when training resumes: it stays unsharded
from its first forward until detach, an exception or the end of a Trainer's training.

A unit's first forward without gradients sets its `reshard_after_forward` to False (the public
setter); training resuming puts every flag back and reshards: a forward with gradients, an
optimizer step, a change of the window's flags, an exception, the end of a Trainer's evaluation,
prediction or training (callback.py), or detach. While a unit is kept, FSDP2's own per-forward
work on it, which does nothing there, is skipped (quiet_generation.py; in every mode on the units
`keep_frozen_unsharded` keeps for the run), and so is transformers' per-token all-reduce where
every unit stays unsharded through a generation (token_sync.py). The pre-hooks sit on every
unit's module, not only the root (PEFT's `generate` runs the inner model without the root's
forward), and are prepended so they run before FSDP's own pre-forward. FSDP1 and DDP: the setting
does not apply (one warning).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from accel_gradsync.planning.units import Unit
from accel_gradsync.runtime.core.decision import describe_generation
from accel_gradsync.runtime.core.state import Attachment, BoundModel, FrozenModel, Removable, root_of
from accel_gradsync.runtime.generating.token_sync import skip_token_sync
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter
from accel_gradsync.runtime.wrappers.quiet_generation import skip_idle_forward_work


class GenerationGather:
    """The units kept unsharded for generation, of every model bound to one `attach()`."""

    def __init__(self, state: Attachment) -> None:
        self.state = state
        self._restores: dict[nn.Module, list[Callable[[], None]]] = {}
        """By bound model: the calls that put back each kept unit's flags, in keeping order."""
        self._kept: dict[nn.Module, set[int]] = {}
        """By bound model: `id` of each unit kept unsharded."""
        self._forced: Counter[nn.Module | None] = Counter()
        """`gathered()` blocks open, by the bound model each names (None: every model): they keep
        that model's units whatever the setting says."""
        self._optimizer_hook: torch.utils.hooks.RemovableHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.state.settings.gather_for_generation

    def keeps(self, root: nn.Module) -> bool:
        """The units of the watched model `root` stay unsharded across its forwards without
        gradients whatever `gathered()` says: the setting, or a frozen model that keeps."""
        frozen = self.state.frozen.get(root)
        return self.enabled or (frozen is not None and frozen.keeps)

    # -- hooks --------------------------------------------------------------------------------
    def watch(self, root: nn.Module) -> list[Removable]:
        """Hooks on each unit module of the bound or frozen model `root`: count forwards without
        gradients, keep their units where the setting, a frozen model or `gathered()` asks,
        release when training resumes. Removing them unwatches `root` alone (a model bound again)."""
        adapter = self.state.adapters[root]
        assert adapter is not None  # bound and frozen models have one
        if adapter.kind != "fsdp2" and self.enabled:
            instead = {
                "fsdp1": "under FSDP1 wrap generation in FSDP.summon_full_params(model) yourself, or use "
                "fsdp_version: 2",
                "ddp": "DDP never shards parameters",
            }[adapter.kind]
            self.state.warn_once(
                "generation_not_fsdp2",
                f"accel_gradsync: gather_for_generation is ignored on {adapter.kind}: it keeps FSDP2 units "
                f"unsharded while generating ({instead}).",
            )
        if adapter.kind != "fsdp2":
            return []
        keeps = self.keeps(root)
        handles = []
        for module, unit in adapter.unit_modules():
            handles.append(module.register_forward_pre_hook(self._pre_hook(root, adapter, unit), prepend=True))
            if keeps:  # gathered() sees its own exceptions
                handles.extend(self._watch_for_raise(module))
        # The root too, unit or not: training resumes before the window counts the micro-batch
        # (its hook on the root runs next), and an exception from a later hook of a unit passes
        # only through the root.
        handles.append(root.register_forward_pre_hook(self._resume_hook, prepend=True))
        if keeps:
            handles.extend(self._watch_for_raise(root))
        if keeps and self._optimizer_hook is None:  # shared by every model: `close` removes it
            self._optimizer_hook = register_optimizer_step_pre_hook(self._before_step)
        # Units kept for the run (keep_frozen_unsharded) are idle at every forward without
        # gradients once gathered, in any mode: gated while watched (each gate checks every call).
        resident = _Gates(skip_idle_forward_work(adapter, [u for u in adapter.units if u.resident]))
        return [*handles, resident, *skip_token_sync(root, lambda: self.keeps_through_generation(root, adapter))]

    def keeps_through_generation(self, root: nn.Module, adapter: ModelAdapter) -> bool:
        """Every unit of the watched model `root` stays unsharded from the first forward without
        gradients on (token_sync.py): kept for generation at that forward (the setting, a frozen
        model that keeps, `gathered()`), or not resharding after forward now (the window's)."""
        if self.keeps(root) or self._forced[None] > 0 or self._forced[root] > 0:
            return True
        return not any(adapter.reshards_now(unit) for unit in adapter.units if unit.shard_size > 1)

    def _resume_hook(self, module: nn.Module, args: Any) -> None:
        """A forward with gradients (in train or eval mode, as the window counts it): training
        resumes, generation's units go back. The first forward without them of a loop whose
        decision line left generation out prints what generation all-gathers, once."""
        if not torch.is_grad_enabled():
            if not self.state.generates:
                self._announce(module)
            return
        if self._kept:
            self.release()

    def _announce(self, root: nn.Module) -> None:
        bound = self.state.bound.get(root)
        if bound is not None:
            self.state.accelerator.print(describe_generation(bound.name, bound.plan, bound.adapter))
            self.state.generated = True

    def _pre_hook(self, key: nn.Module, adapter: ModelAdapter, unit: Unit) -> Callable:
        always = self.keeps(key)

        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():  # training resumes (`_resume_hook`), before FSDP's own pre-forward runs
                if self._kept:
                    self.release()
                return
            keep = always or self._forced[None] > 0 or self._forced[key] > 0
            if keep and id(unit) not in self._kept.setdefault(key, set()):
                self._kept[key].add(id(unit))
                self._restores.setdefault(key, []).append(adapter.keep_params_through_forward([unit]))
                self._restores[key].append(skip_idle_forward_work(adapter, [unit]))  # undone first

        return hook

    def _watch_for_raise(self, module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Release everything kept when a forward of `module` raises (FSDP is left mid-forward).

        Two forward hooks, one after the other: the first runs only when the forward (and the
        hooks before it) returned; the second always runs (`always_call`), also while the
        exception propagates, and finds the first one's mark missing. The ambient exception state
        cannot tell: inside a caller's `except` block (a retry after a timeout) it holds the
        exception being handled, not one from this forward."""
        returned: list[bool] = []

        def mark_returned(module: nn.Module, args: Any, output: Any) -> None:
            returned.append(True)

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            if returned:
                returned.pop()
            elif self._kept and not torch.is_grad_enabled():
                self.release(raised=True)

        return [
            module.register_forward_hook(mark_returned),
            module.register_forward_hook(after_forward, always_call=True),
        ]

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer pre-step hook: nothing gathered for generation survives into a step."""
        if self._kept:
            self.release()

    # -- keeping and releasing -----------------------------------------------------------------
    def release(self, raised: bool = False, models: Iterable[nn.Module] | None = None, resident: bool = False) -> None:
        """Put every flag generation changed back and reshard the kept units that reshard after
        forward, of the bound `models` (default: all). Units that do not (FSDP2's root) stay as
        FSDP leaves them after any forward without gradients: PEFT's `generate` runs the inner
        model without the root's forward and relies on that. A resident reference model stays
        unless `resident` (detach, the end of training) or `raised` (FSDP left mid-forward)."""
        for key in list(self._kept) if models is None else [k for k in models if k in self._kept]:
            frozen = self.state.frozen.get(key)
            if frozen is not None and frozen.resident and not (resident or raised):
                continue
            adapter = self.state.adapters.get(key)
            restores = self._restores.pop(key, [])
            kept = self._kept.pop(key)
            for restore in reversed(restores):
                restore()
            if adapter is None:
                continue
            if raised and adapter.held_grad_bytes() == 0 and adapter.reset_after_exception():
                continue  # FSDP's own recovery resharded every unit
            adapter.reshard_unless_kept([u for u in adapter.units if id(u) in kept])

    @contextlib.contextmanager
    def gathered(self, model: nn.Module | None = None) -> Iterator[None]:
        """Keep each unit of `model` (default: of every bound model) that runs a forward without
        gradients inside the block unsharded from its first such forward to the end of the block;
        then reshard them. Other models' units gather and reshard as without the block. Any
        setting."""
        key = None if model is None else root_of(model)
        watched: dict[nn.Module, BoundModel | FrozenModel] = {**self.state.bound, **self.state.frozen}
        if key is not None and key not in watched:
            raise ValueError(
                "grad_sync.gathered(model): the model is not bound to this attach() (pass the model "
                "accelerator.prepare returned, with FSDP2)."
            )
        kinds = {w.adapter.kind for w in watched.values()} if key is None else {watched[key].adapter.kind}
        others = ", ".join(sorted(kinds - {"fsdp2"}))
        if others:
            self.state.warn_once(
                "gathered_not_fsdp2",
                f"accel_gradsync: gathered() keeps FSDP2 units unsharded; it does nothing for {others} "
                "models (FSDP1: FSDP.summon_full_params(model); DDP keeps whole parameters anyway).",
            )
        self._forced[key] += 1
        try:
            yield
        except BaseException:
            self._forced[key] -= 1
            self.release(raised=True)  # the exception may have left any model mid-forward
            raise
        self._forced[key] -= 1
        if self._forced[None] == 0:  # a block over every model still open keeps them all
            ended = list(self._kept) if key is None else [key]
            self.release(models=[k for k in ended if self._forced[k] == 0])

    def close(self) -> None:
        """Detach: put everything back."""
        self.release(resident=True)
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None


class _Gates:
    """The gates on a watched model's resident units, as a handle binding removes (`Removable`)."""

    def __init__(self, restore: Callable[[], None]) -> None:
        self.remove = restore
