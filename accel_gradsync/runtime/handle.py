"""`GradSyncHandle`: what `attach` returns. It builds one attach's owners (state.py's `Attachment`
and bound models, bind.py's `Binder`, window.py's `Window`, generation.py's `GenerationGather`,
checkpoint.py's `CheckpointHooks`, join.py's `Join`), connects them to the Accelerator and Trainer
(connection.py), and answers for them: `stats()`, `plan()`, `units()`, `gathered()`,
`reshard_frozen()`, `join()`, `step()`, `detach()`; with `save_on_signal`, a loop of its own asks
`preempted()` and calls `exit_preempted()` (preemption.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from accelerate import Accelerator
from torch import nn

from accel_gradsync.config.settings import ResolvedConfig
from accel_gradsync.planning.memory import MemoryProbe
from accel_gradsync.planning.policies import SyncPolicy
from accel_gradsync.planning.replan import Forecaster
from accel_gradsync.planning.units import Plan
from accel_gradsync.runtime.accumulation.window import Window
from accel_gradsync.runtime.core.state import Attachment, root_of
from accel_gradsync.runtime.faults.checkpoint import CheckpointHooks
from accel_gradsync.runtime.faults.preemption import PREEMPTED_EXIT_CODE
from accel_gradsync.runtime.generating.generation import GenerationGather
from accel_gradsync.runtime.integration.bind import Binder, wants_binding
from accel_gradsync.runtime.integration.connection import Connection
from accel_gradsync.runtime.uneven_inputs.join import Join
from accel_gradsync.runtime.uneven_inputs.uneven_steps import StepShape, UnevenSteps
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter


class GradSyncHandle:
    """What `attach` returns: live counters (`stats()`), the plan, and `detach()`."""

    def __init__(
        self,
        accelerator: Accelerator,
        settings: ResolvedConfig,
        trainer: Any = None,
        memory_probe: MemoryProbe | None = None,
        forecaster: Forecaster | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.settings = settings
        """The settings attach() resolved, typed (`GradSyncConfig.resolved()`)."""
        self._state = Attachment(accelerator, settings, trainer)
        self.policy: SyncPolicy = self._state.policy
        self._generation = GenerationGather(self._state)
        self._window = Window(self._state, self._generation)
        self._binder = Binder(self._state, self._window, self._generation, memory_probe, forecaster)
        self._checkpoints = CheckpointHooks(self._state)
        self._join = Join(self._state)
        self._steps = UnevenSteps(self._state, self._window, self._join)
        self._connected = False  # connect() ran (attach's last step)
        self._connection = Connection(
            accelerator,
            self._state,
            self._binder,
            self._window,
            self._generation,
            self._checkpoints,
            self._join,
            self._steps,
        )

    # -- public ---------------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        """M: micro-batches per optimizer step (the Trainer keeps it outside accelerate)."""
        return self._state.micro_batches_per_step

    def stats(self) -> dict:
        """What ran since `attach`, counted by the plugin from each unit's flags.

        Returns:
            `dict`: `micro_batches` (and `deferred_micro_batches`), `optimizer_steps`,
            `reduce_scatters_issued` / `_skipped` and `all_reduces_issued` / `_skipped` (unit
            syncs), `all_gathers` (training) and `generation_all_gathers` (forwards without
            gradients), `replicated_all_reduces` (those transformers' Trainer issues itself for
            an adapter added after load-time sharding), `bytes_reduced`, `peak_held_grad_bytes`,
            the plan's `mode` and each unit's level (`unit_modes`, `units_<level>`), under `auto`
            its `measured_peaks`, `plan_changes` and the plan's `forecast_peak_bytes` (with the
            forecast shape); a frozen reference model's all-gathers apart (`reference_all_gathers`,
            `reference_units`, `reference_models`); the same counts for the last finished optimizer
            step under `last_step/`; with several models, each one's under `models`.
        """
        return self._state.stats()

    def plan(self, model: nn.Module | None = None) -> Plan | None:
        """The plan in force for one model.

        Args:
            model (`torch.nn.Module`, *optional*): a bound model; default: the first one bound.

        Returns:
            `Plan` or `None`: its mode, held and windowed units and why; `None` while the model
            is not bound (not prepared yet, not wrapped, or nothing to train).
        """
        bound = self._state.bound
        if model is not None:
            return bound[root_of(model)].plan if root_of(model) in bound else None
        return next((b.plan for b in bound.values()), None)

    def units(self, model: nn.Module | None = None) -> list:
        """The FSDP units (DDP: the whole model) the plugin plans over.

        Args:
            model (`torch.nn.Module`, *optional*): a bound model; default: the first one bound.

        Returns:
            `list[accel_gradsync.planning.units.Unit]`: name, sizes and dtypes of each unit, frozen ones
            included; empty while the model is not bound.
        """
        key = root_of(model) if model is not None else next(iter(self._state.bound), None)
        adapter = self._state.adapters.get(key) if key is not None else None
        return list(adapter.units) if adapter is not None else []

    def describe(self) -> str:
        """The decision line of the first bound model, as printed at bind.

        Returns:
            `str`: e.g. `grad sync: deferred over 4 micro-batches on fsdp2 (3 deferred) -> ...`.
        """
        bound = next(iter(self._state.bound.values()), None)
        if bound is None:
            return f"grad sync: {self.policy.name} (no FSDP/DDP model bound yet)"
        return self._state.describe(bound)

    def bind(self, model: nn.Module) -> ModelAdapter | None:
        """Inspect a model once: its wrapper and units, its plan and counters; prints the
        decision line. Models accelerate prepares, the Trainer's, and a model at its first
        `no_sync` are bound without this call; call it for a model accelerate did not prepare
        (one transformers sharded at load time) before its first step.

        Args:
            model (`torch.nn.Module`): a model wrapped in FSDP2, FSDP1 or DDP.

        Returns:
            `ModelAdapter` or `None`: `None` where the model is not wrapped (accelerate's own
            `no_sync` then applies, with one warning).

        Raises:
            `ValueError`: the accelerate config asks for FSDP and the model is not FSDP-wrapped,
                or the sync mode cannot run on its wrapper (`budget` and `defer_all_reduce` need
                FSDP2, `defer_all_reduce` an HSDP mesh).
        """
        return self._binder.bind(model)

    def gathered(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Keep the FSDP2 units of `model` unsharded through its forwards without gradients
        inside the block (another model's forwards gather and reshard as without it):
        `with grad_sync.gathered(model): model.generate(...)`. Each unit all-gathers once instead
        of once per forward (per generated token); all are resharded when the block ends, also on
        an exception. What `gather_for_generation` does by itself; it costs the unsharded
        parameters (compute dtype) on every rank while the block runs.

        Args:
            model (`torch.nn.Module`, *optional*): a bound model; default: every bound model.

        Returns:
            A context manager.

        Raises:
            `ValueError`: `model` is not bound to this `attach()`.
        """
        return self._generation.gathered(model)

    def reshard_frozen(self) -> None:
        """Reshard the frozen units `keep_frozen_unsharded` keeps for the run; the next forward
        all-gathers each of them once more, and keeps it again. Between optimizer steps a kept
        unit's parameters are plain tensors: call this first where code works on the sharded
        model's DTensors there, such as merging a LoRA adapter for a weight sync
        (`grad_sync.reshard_frozen(); model.merge_adapter(); ...full_tensor()...;
        model.unmerge_adapter()`, as TRL's vLLM sync does). Costs one all-gather of each kept
        unit at the next forward; does nothing where no unit is kept.
        """
        self._state.residency.reshard()

    def join(self) -> contextlib.AbstractContextManager:
        """Around a loop of your own in which ranks run different numbers of micro-batches
        (dynamic batching, an uneven last shard): `with grad_sync.join(): for batch in loader: ...`.
        A rank whose data runs out replays its last micro-batch with its outputs x 0, inside
        `accumulate()`, while any other rank trains, and steps the optimizers and schedulers
        accelerate prepared, so FSDP's collectives pair in every mode and every shard steps. The
        run ends where one ends in which that rank ran extra micro-batches of loss x 0: DDP's
        `Join` with `divide_by_initial_world_size=True`. Costs one small all-reduce per micro-batch.

        Raises:
            `ValueError`, on every rank: a rank left with no micro-batch of its own inside the block,
                a forward outside `accumulate()` or `wait_for_everyone()` inside it, `even_batches=False`
                with `sync_with_dataloader`; a Trainer (its ranks run equal counts).
        """
        return self._join.joined()

    def step(
        self, n: int, tokens: int | None = None, samples: int | None = None
    ) -> contextlib.AbstractContextManager[StepShape]:
        """Around one optimizer step in which this rank runs `n` micro-batches, a count of its own
        that may differ from the other ranks' and change every step (micro-batches packed by a
        token budget): `with grad_sync.step(len(batches)) as step: for batch in batches: with
        accelerator.accumulate(model): ...`. Every rank enters it, before the step's first
        micro-batch; it sets accelerate's `gradient_accumulation_steps` to `n` for the block (its
        counter restarted), so `accumulate()` syncs at this rank's n-th micro-batch, and puts it
        back after. The step ends where padding every rank to the step's largest count with
        micro-batches of loss x 0 ends: under a plan whose collectives do not depend on the count
        (every FSDP2 unit windowed: `keep_params_unsharded` with deferral; any deferring mode on
        DDP) with no extra work; otherwise a rank below the largest count replays its last
        micro-batch x 0 up to it, at its first clip,
        loop collective or optimizer step after that micro-batch's `accelerator.backward`. Costs
        one small collective per step, on the plugin's own group (two in a step with replays).

        Args:
            n (`int`): this rank's micro-batches in the step, at least 1.
            tokens (`int`, *optional*): this rank's tokens in the step (summed over every rank in
                `step.tokens`, the number to scale a summed loss by).
            samples (`int`, *optional*): the same for samples.

        Returns:
            A context manager giving a `StepShape`: `micro_batches`, the step's `largest` and
            `smallest` counts, `tokens`, `samples` (`stats()` counts the replays).

        Raises:
            `ValueError`: `n` below 1 on any rank (on every rank); a Trainer; inside `join()` or
                another `step()`; mid-window; a prepared DataLoader with `sync_with_dataloader`; a
                rank that ran another count than its `n`, or, in a step with replays, an optimizer
                step before the last micro-batch's backward on any rank (both at the block's end);
                in a step whose counts differ, a loop collective (`accelerator.gather`, `reduce`,
                ...) between two of this rank's micro-batches (there).
        """
        return self._steps.step(n, tokens, samples)

    def preempted(self) -> bool:
        """A loop of its own with `save_on_signal`: True, on every rank alike, at the end of the
        optimizer step in which any rank got the signal; then save (`accelerator.save_state`) and
        call `exit_preempted()`. Call it on every rank after every micro-batch (or at least after
        each one that ends an optimizer step): it is a collective there, and answers False without
        one inside an accumulation window. False without a collective when `save_on_signal` is
        `none`, and inside `join()` (a rank that left would never ask, and `save_state` is refused
        there): ask again after the block. (A Trainer asks by itself.)

        Returns:
            `bool`: whether to save and exit now.
        """
        preemption = self._connection.preemption
        if preemption is not None and self._join.inside:
            self._state.warn_once(
                "preempted_inside_join",
                "accel_gradsync: grad_sync.preempted() answers False inside grad_sync.join(): a rank that left the "
                "loop would never ask, and save_state() is refused there. Ask after the `with grad_sync.join():` "
                "block too; a signal that came inside it is acted on there.",
            )
        return preemption is not None and preemption.ask(self.accelerator, inside_join=self._join.inside)

    def exit_preempted(self, checkpoint: str | None = None) -> None:
        """After `preempted()` said True and the checkpoint is saved on every rank: print one line
        (naming `checkpoint`) and exit with `PREEMPTED_EXIT_CODE` on every rank; under torch
        elastic with `--max_restarts`, without the agent spending a restart (docs/recipe.md).

        Raises:
            `ValueError`: `preempted()` has not said True.
        """
        preemption = self._connection.preemption
        if preemption is None or not preemption.agreed:
            raise ValueError(
                "grad_sync.exit_preempted() is for after grad_sync.preempted() returned True and the "
                "checkpoint is saved; call it only then."
            )
        saved = f"saved {checkpoint}" if checkpoint is not None else "saved"
        self.accelerator.print(
            f"accel_gradsync: {preemption.signum.name}: {saved}; exiting with code {PREEMPTED_EXIT_CODE}."
        )
        preemption.exit(self.accelerator)

    def detach(self) -> None:
        """Undo `attach`: every unit's flags as they were, every unit the plugin kept unsharded
        (for generation, a resident model, a window left mid-way) resharded, the accelerator's
        (and a Trainer's) own class, hooks and callback removed. Gradients a window held stay
        where FSDP keeps them, and the next synced backward reduces them. The counters stay readable."""
        self._generation.close()  # units kept for generation: flags back, resharded
        self._state.residency.release()  # keep_frozen_unsharded's units: flags back, resharded
        self._window.end_hold()  # a window left mid-way: its flags back
        adapters = [b.adapter for b in self._state.bound.values()] + [f.adapter for f in self._state.frozen.values()]
        for adapter in adapters:
            adapter.reshard(adapter.units)  # what the window kept: plain tensors no more
        self._connection.disconnect()
        self._binder.close()
        self._state.control.close()

    def __enter__(self) -> GradSyncHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- assembly (accel_gradsync/_attach.py) ----------------------------------------------------
    def connect(self, models: list | None) -> None:
        """`attach()`'s last step, once, after its checks: with `save_on_signal`, the handler (also
        where attach() does nothing else: `models` None); then bind `models`, those prepared
        before attach, and connect the policy to the accelerator, its checkpoints and the Trainer
        (connection.py). On a refusal everything is undone (`detach`) before it raises.

        Raises:
            `ValueError`: called again; what binding refuses.
        """
        if self._connected:
            raise ValueError("GradSyncHandle.connect() is attach()'s own step and runs once; call attach() instead.")
        self._connected = True
        self._connection.add_save_on_signal()
        if models is None:
            return
        try:
            for model in models:
                if wants_binding(self.accelerator, model):
                    self.bind(model)
        except Exception:
            self.detach()
            raise
        self._connection.connect()
