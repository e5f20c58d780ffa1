"""What one `attach()` keeps, and its owners: `Attachment` (the accelerator, the settings resolved
once, every model seen) and, per bound model, `BoundModel`, which owns the model's plan, its `auto`
planner, its counters and the flags its window holds, and changes them only through its methods.
The runtime parts (bind.py, window.py, generation.py, the checkpoints) receive these objects.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import ResolvedConfig
from accel_gradsync.planning.costs import counts_are_free
from accel_gradsync.planning.policies import SyncPolicy, resolve_policy
from accel_gradsync.planning.replan import Change, MeasuredAuto
from accel_gradsync.planning.residency import kept_bytes
from accel_gradsync.planning.units import Plan, Unit
from accel_gradsync.runtime.core.accounting import SyncAccounting, combined_stats
from accel_gradsync.runtime.core.agreement import ControlGroup
from accel_gradsync.runtime.core.decision import describe_decision
from accel_gradsync.runtime.wrappers.adapter import ModelAdapter
from accel_gradsync.runtime.wrappers.frozen_units import FrozenResidency
from accel_gradsync.runtime.wrappers.quiet_generation import skip_idle_forward_work

NOT_READ = -1
"""An `auto_read_at` no step count has: the next window start re-plans."""


class Removable(Protocol):
    """What binding puts on a model and takes off again: a torch hook's handle, or the handle of
    a wrapper (token_sync.py)."""

    def remove(self) -> None: ...


@dataclass
class _Hold:
    """The flags one model's window holds, set at its first held micro-batch."""

    plan: Plan
    held: tuple[int, ...]
    """`id` of each held unit: fewer than the plan's while some cannot hold yet (`holdable`)."""
    flags: contextlib.ExitStack
    """Closing it puts every flag back (`ModelAdapter.hold`)."""


@dataclass
class BoundModel:
    """A prepared model with trainable units: what `bind` found and decided for it."""

    name: str
    """The user's class name, `#2`-suffixed when another bound model has it (stats() keys)."""
    adapter: ModelAdapter
    plan: Plan
    account: SyncAccounting
    auto: MeasuredAuto | None = None
    """`auto` over more than one micro-batch: measures step 1, re-plans at window starts."""
    auto_read_at: int = 0
    """The optimizer steps done when `auto` last read a peak: it reads once per finished step. A
    window an exception ended is no step (no optimizer state yet after a first one): its peak
    counts into the next window's, which auto then reads."""
    hold: _Hold | None = None
    """The flags this model's window set, until its last forward."""

    def stats(self) -> dict:
        """This model's `stats()`: the counters, with the plan's levels and `auto`'s record."""
        levels = {u.name: self.plan.level(u) for u in self.adapter.units}
        resident = [u for u in self.adapter.units if u.resident]  # keep_frozen_unsharded's
        kept = {"units_resident": len(resident), "resident_param_bytes": sum(u.param_bytes for u in resident)}
        if self.auto is None:
            return {**self.account.stats(self.plan.mode, levels), **kept}
        auto = self.auto
        changes, peaks, forecast = auto.changes, list(auto.peaks), auto.forecast_of(self.plan)
        return {**self.account.stats(self.plan.mode, levels, changes, peaks, forecast), **kept}

    @property
    def started(self) -> bool:
        """A micro-batch of it has run: its plan is in use."""
        return self.account.total.micro_batches + self.account.current.micro_batches > 0

    def take_plan(self, plan: Plan) -> None:
        """Replace the plan before the model's first micro-batch (a reference model bound after
        it changed what budget or auto may hold)."""
        assert not self.started and self.hold is None  # nothing applied the old plan yet
        self.plan = plan

    def replan(self, micro_batches: int) -> Change | None:
        """At a window's first held micro-batch: under `auto`, read the last finished step's peak
        once and take the plan it gives."""
        if self.auto is None or self.auto_read_at == self.account.optimizer_steps:
            return None
        self.auto_read_at = self.account.optimizer_steps
        change = self.auto.at_window_start(self.adapter, self.plan, micro_batches)
        if change is not None:
            self.plan = change.plan
        return change

    def resume_auto(self, plan: Plan, record: dict, mid_window: bool) -> None:
        """Take the `auto` plan and record a checkpoint saved: mid-window the window under way
        keeps the plan; at a boundary the next window start re-plans."""
        assert self.auto is not None  # resumed for auto's models only
        self.plan = plan
        self.auto.restore(record)
        self.auto_read_at = self.account.optimizer_steps if mid_window else NOT_READ

    def holds(self, held: Sequence[Unit]) -> bool:
        """The window already holds exactly `held` under the current plan."""
        return self.hold is not None and self.hold.plan == self.plan and self.hold.held == _ids(held)

    def start_hold(self, held: Sequence[Unit]) -> None:
        """Set the flags the plan holds for `held` (the window's first held micro-batch)."""
        assert self.hold is None  # end_hold first
        windowed = [u for u in self.plan.windowed if id(u) in _ids(held)]
        flags = contextlib.ExitStack()
        flags.enter_context(self.adapter.hold(held, self.plan.held_sync, windowed))
        # Windowed units stay unsharded through the window: forwards without gradients in it (TRL
        # generates in its first micro-batch) skip FSDP2's idle per-forward work; undone first.
        flags.callback(skip_idle_forward_work(self.adapter, windowed))
        self.hold = _Hold(self.plan, _ids(held), flags)

    def end_hold(self) -> None:
        """Put back the flags the window set."""
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.flags.close()


@dataclass
class FrozenModel:
    """An FSDP2 model nothing trains (a reference model): prepared with no trainable parameter, or
    held by the Trainer besides the model it trains (TRL's `ref_model`, whose parameters keep
    `requires_grad`). No gradient to schedule, only its all-gathers, counted apart
    (`reference_all_gathers`), and, where `keeps`, its units kept unsharded across the forwards
    without gradients of one pass (generation.py)."""

    name: str
    adapter: ModelAdapter
    account: SyncAccounting
    """Its all-gathers, by optimizer step (`SyncAccounting.end_step`)."""
    keeps: bool
    """Its units stay unsharded from their first forward without gradients until training resumes:
    by default where the model is one unit (a forward of it gathers the whole model anyway), with
    `gather_for_generation` whatever its units; always where `resident`."""
    resident: bool = False
    """Its units stay unsharded from their first forward for the whole run, training included
    (`keep_reference_unsharded`, planning/residency.py): only detach, an exception, the end of a
    Trainer's training or FSDP2's own state-dict hooks (a checkpoint) reshard them."""

    @property
    def kept_bytes(self) -> int:
        """Unsharded param bytes per rank it keeps beyond what one of its forwards gathers anyway:
        resident, all of them for the whole run; else through a pass, all but its largest unit (0
        for one unit or where it does not keep). Budget and auto plan the trained models within
        memory less this (`SyncPolicy.plan`'s `reserved`)."""
        return kept_bytes(self.adapter.units, self.keeps, self.resident)

    def stats(self) -> dict:
        return {
            "units": len(self.adapter.units),
            "keeps": self.keeps,
            "resident": self.resident,
            "all_gathers": self.account.total.generation_all_gathers + self.account.total.all_gathers,
            "last_step/all_gathers": self.account.last_step.generation_all_gathers + self.account.last_step.all_gathers,
        }


def _ids(units: Sequence[Unit]) -> tuple[int, ...]:
    return tuple(id(u) for u in units)


@dataclass
class Attachment:
    """The accelerator and settings of one `attach()`, and every model it has seen, by `root_of(model)`."""

    accelerator: Accelerator
    settings: ResolvedConfig
    """The settings `attach` resolved, once (explicit > environment > default, typed)."""
    trainer: Any = None
    policy: SyncPolicy = field(init=False)
    adapters: dict[nn.Module, ModelAdapter | None] = field(default_factory=dict)
    """Every model `bind` inspected; None where it is not wrapped (accelerate's no_sync applies)."""
    bound: dict[nn.Module, BoundModel] = field(default_factory=dict)
    """The models with trainable units, in bind order (the first one is the default of plan())."""
    frozen: dict[nn.Module, FrozenModel] = field(default_factory=dict)
    """The FSDP2 models nothing trains (reference models), by `root_of(model)`."""
    control: ControlGroup = field(init=False)
    """The gloo group of the plugin's own collectives (agreement.py), made here on every rank."""
    residency: FrozenResidency = field(default_factory=FrozenResidency)
    """The frozen units `keep_frozen_unsharded` keeps for the run (frozen_units.py)."""
    warned: set[str] = field(default_factory=set)
    window_seen: int = 0
    """Micro-batches of the first window of a loop that holds them with `no_sync` outside
    `accumulate()` while the Accelerator says one per step (0 until such a window ends)."""
    step_largest: int = 0
    """Inside `grad_sync.step(n)` (uneven_steps.py): the step's largest count over ranks, the M
    every rank plans with and the decision line names (0 outside)."""
    per_rank_counts: bool = False
    """`grad_sync.step(n)` has run: decision lines say what per-rank counts cost from then on."""
    generated: bool = False
    """A bound FSDP2 model ran a forward without gradients (generation.py): a loop of its own
    generates, evaluates or scores."""

    def __post_init__(self) -> None:
        self.policy = resolve_policy(self.settings)
        self.control = ControlGroup()

    @property
    def micro_batches_per_step(self) -> int:
        """M: micro-batches per optimizer step (the Trainer keeps it outside accelerate; a loop
        with `no_sync` and `gradient_accumulation_steps=1` shows it in its first window; inside
        `grad_sync.step(n)` the step's largest count)."""
        if self.trainer is not None:
            return int(self.trainer.args.gradient_accumulation_steps)
        if self.step_largest:
            return self.step_largest
        return int(self.accelerator.gradient_accumulation_steps) if not self.window_seen else self.window_seen

    @property
    def generates(self) -> bool:
        """Whether the decision line says what generation all-gathers: a Trainer's (GRPO's
        generates; the estimate shows it too), `gather_for_generation`, or a loop of its own once
        a bound model ran a forward without gradients (until then its line leaves generation out)."""
        return self.trainer is not None or bool(self.settings.gather_for_generation) or self.generated

    def counts_are_free(self) -> bool:
        """Per-rank micro-batch counts add no collective under the plans now: every bound model's
        step issues the same collectives whatever its count, and every frozen model is resident
        (one that is not gathers per forward)."""
        free = all(counts_are_free(b.plan, b.adapter) for b in self.bound.values())
        return free and all(f.resident for f in self.frozen.values())

    def describe(self, bound: BoundModel, micro_batches: int | None = None) -> str:
        """`bound`'s decision line (decision.py) as this attach prints it: over `micro_batches`
        (default: M), with generation where it `generates`, with per-rank counts where
        `grad_sync.step(n)` has run."""
        m = micro_batches or self.micro_batches_per_step
        free = self.counts_are_free() if self.per_rank_counts else None
        return describe_decision(bound.plan, bound.adapter, m, self.generates, free)

    def stats(self) -> dict:
        """Every bound model's counters, combined (`GradSyncHandle.stats`), and the frozen
        models' all-gathers apart (`reference_*`, each one's under `reference_models`)."""
        out = combined_stats({b.name: b.stats() for b in self.bound.values()}, self.policy.name)
        frozen = {f.name: f.stats() for f in self.frozen.values()}
        out["reference_units"] = sum(f["units"] for f in frozen.values())
        out["reference_all_gathers"] = sum(f["all_gathers"] for f in frozen.values())
        out["last_step/reference_all_gathers"] = sum(f["last_step/all_gathers"] for f in frozen.values())
        out["reference_models"] = frozen
        return out

    def writes_shared_files(self) -> bool:
        """This process writes a checkpoint's shared files: the main process, or each node's first
        one where checkpoints are saved on each node (accelerate's `save_on_each_node`, the
        Trainer's `should_save`), as accelerate and the Trainer write their own."""
        if self.trainer is not None:
            return bool(self.trainer.args.should_save)
        if self.accelerator.project_configuration.save_on_each_node:
            return self.accelerator.is_local_main_process
        return self.accelerator.is_main_process

    def warn_once(self, key: str, message: str) -> None:
        """A warning that would otherwise repeat every micro-batch or checkpoint, once per attach."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, GradSyncWarning, stacklevel=4)


def root_of(model: nn.Module) -> nn.Module:
    """The module a model is known by: DDP's inner module (accelerate lists DDP models unwrapped
    and the forward hooks sit inside DDP's wrapper), else the model itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model
