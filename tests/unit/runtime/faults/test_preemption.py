"""`save_on_signal` on a real transformers Trainer (one process, CPU): the signal at any moment of
a step saves a checkpoint at the end of that optimizer step and ends `train()` with
`PREEMPTED_EXIT_CODE` (after the last step: its own action, once);
`none` leaves the signal alone; every source of the setting agrees with DEFAULTS. The multi-rank
runs (agreement across ranks, the launcher, resuming byte-equal) are in
tests/distributed/test_recipe_restart.py."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import accel_gradsync
from accel_gradsync import PREEMPTED_EXIT_CODE, GradSyncConfig, GradSyncWarning
from accel_gradsync.config.settings import DEFAULTS
from accel_gradsync.runtime.integration.callback import SaveOnSignal

ENV = "ACCEL_GRADSYNC_SAVE_ON_SIGNAL"


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class SignalAt(TrainerCallback):
    """Sends `signum` to this process after the first micro-batch of optimizer step `step`."""

    def __init__(self, signum: int, step: int) -> None:
        self.signum, self.step = signum, step

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), self.signum)


def trainer(tmp_path, jit: bool = False, caught: list | None = None, **config) -> Trainer:
    """A Trainer on one process with the plugin attached; `jit`: transformers' own
    `enable_jit_checkpoint` too; `caught` collects the plugin's warnings at attach."""
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(64)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        enable_jit_checkpoint=jit,
    )
    t = Trainer(model=Regression(), args=args, train_dataset=data)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        accel_gradsync.attach(t, GradSyncConfig(**config))
    ours = [str(w.message) for w in record if issubclass(w.category, GradSyncWarning)]
    if caught is not None:  # one process: attach also says there is no sync to schedule
        caught.extend(m for m in ours if "single process" not in m)
    return t


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # Set, then deleted, so that monkeypatch gives back the value from before the test: the recipe's
    # `run` sets its default here, which later tests' launches would otherwise inherit.
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv(ENV)
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_the_signal_mid_window_saves_that_step_and_exits_with_the_code(tmp_path):
    t = trainer(tmp_path, save_on_signal="SIGUSR1")
    t.add_callback(SignalAt(signal.SIGUSR1, step=3))
    with pytest.raises(SystemExit) as exited:
        t.train()
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-3"]
    assert t.state.global_step == 3


def test_the_signal_twice_and_during_the_save_makes_one_checkpoint(tmp_path):
    t = trainer(tmp_path, save_on_signal="SIGUSR1")
    t.add_callback(SignalAt(signal.SIGUSR1, step=2))
    t.add_callback(SignalAt(signal.SIGUSR1, step=2))
    with pytest.raises(SystemExit):
        t.train()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-2"]


class SignalOn(TrainerCallback):
    """Sends `signum` once, at `event` of optimizer step `step` (1-based; a callback added after
    attach's runs after it at each event)."""

    def __init__(self, signum: int, event: str, step: int) -> None:
        self.signum, self.event, self.step, self.sent = signum, event, step, False

    def _at(self, event: str, state) -> None:
        in_step = state.global_step == (self.step if event == "step_end" else self.step - 1)
        if event == self.event and in_step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_step_begin(self, args, state, control, **kwargs):
        self._at("step_begin", state)

    def on_substep_end(self, args, state, control, **kwargs):
        self._at("substep_end", state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._at("pre_optimizer_step", state)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._at("optimizer_step", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._at("step_end", state)


EVENTS = ("step_begin", "substep_end", "pre_optimizer_step", "optimizer_step", "step_end")


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("step", [1, 3, 6])
def test_a_signal_at_any_moment_of_a_step_saves_once(tmp_path, event, step):
    """Anywhere in optimizer step `step`, the Trainer saves at its end and exits with the code; at
    its `on_step_end`, after the ranks agreed for it, at the next step's end; after the last one,
    training ends as without the plugin and the signal keeps its own action, once."""
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    t = trainer(tmp_path, save_on_signal="SIGUSR1")
    callback = SignalOn(signal.SIGUSR1, event, step)
    t.add_callback(callback)
    saved_at = step + (event == "step_end")
    if saved_at > t.args.max_steps:
        t.train()
        assert callback.sent and got == [signal.SIGUSR1]
        assert not list((tmp_path / "out").glob("checkpoint-*"))
        return
    with pytest.raises(SystemExit) as exited:
        t.train()
    assert exited.value.code == PREEMPTED_EXIT_CODE and callback.sent and got == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"checkpoint-{saved_at}"]
    assert t.state.global_step == saved_at


def test_none_adds_no_callback_and_keeps_the_signal_as_it_was(tmp_path):
    t = trainer(tmp_path)
    assert not any(isinstance(c, SaveOnSignal) for c in t.callback_handler.callbacks)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # pytest leaves SIGUSR1 alone
    t.train()  # no exit
    assert t.state.global_step == 6


def test_a_run_that_got_no_signal_gives_the_handler_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    t = trainer(tmp_path, save_on_signal="SIGTERM")
    assert signal.getsignal(signal.SIGTERM) != before
    t.train()
    assert t.state.global_step == 6
    assert signal.getsignal(signal.SIGTERM) == before


def test_transformers_jit_checkpoint_on_the_same_signal_gives_way_with_one_line(tmp_path):
    """`enable_jit_checkpoint` saves on SIGTERM too (a timer per rank, so ranks may save at different
    steps): with both on SIGTERM, the plugin's acts alone and says so once; one checkpoint is saved."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    caught: list[str] = []
    t = trainer(tmp_path, jit=True, caught=caught, save_on_signal="SIGTERM")
    assert len(caught) == 1 and "\n" not in caught[0], caught
    assert "enable_jit_checkpoint" in caught[0] and "save_on_signal" in caught[0], caught[0]
    assert not any(isinstance(c, JITCheckpointCallback) for c in t.callback_handler.callbacks)
    t.add_callback(SignalAt(signal.SIGTERM, step=3))
    with pytest.raises(SystemExit) as exited:
        t.train()
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-3"]
    assert not (tmp_path / "out" / "checkpoint-3" / "checkpoint-is-incomplete.txt").exists()


def test_with_transformers_jit_checkpoint_a_run_without_the_signal_gives_back_the_handler_from_before(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    t = trainer(tmp_path, jit=True, save_on_signal="SIGTERM")
    t.train()
    assert t.state.global_step == 6
    assert signal.getsignal(signal.SIGTERM) == before


def test_transformers_jit_checkpoint_on_another_signal_is_left_alone(tmp_path):
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    caught: list[str] = []
    t = trainer(tmp_path, jit=True, caught=caught, save_on_signal="SIGUSR1")
    assert caught == []
    assert any(isinstance(c, JITCheckpointCallback) for c in t.callback_handler.callbacks)


def test_detach_removes_the_callback_and_gives_the_handler_back(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no")
    t = Trainer(model=Regression(), args=args, train_dataset=[{"x": torch.randn(4), "labels": torch.randn(())}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: attach says there is no sync to schedule
        handle = accel_gradsync.attach(t, GradSyncConfig(save_on_signal="SIGUSR1"))
    assert any(isinstance(c, SaveOnSignal) for c in t.callback_handler.callbacks)
    assert signal.getsignal(signal.SIGUSR1) != before
    handle.detach()
    assert not any(isinstance(c, SaveOnSignal) for c in t.callback_handler.callbacks)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_every_source_agrees_on_the_setting(monkeypatch):
    assert DEFAULTS["save_on_signal"] == "none" == GradSyncConfig().save_on_signal
    monkeypatch.setenv(ENV, "SIGUSR1")
    assert GradSyncConfig().save_on_signal == "SIGUSR1"
    assert GradSyncConfig(save_on_signal="none").save_on_signal == "none"  # explicit wins
    monkeypatch.setenv(ENV, "USR2")
    with pytest.raises(ValueError, match=f"{ENV}='USR2' is not a valid `save_on_signal`; valid choices: none"):
        GradSyncConfig()


def test_the_recipe_saves_on_sigterm_unless_told_otherwise(monkeypatch, capsys):
    """recipes/grpo.py's default comes in below an explicit value and the environment, as the
    environment's own does, and its --help says so."""
    from accelerate.state import AcceleratorState

    from tests.unit.config.test_settings import _recipe

    recipe = _recipe()
    # What run() hands on past parsing, seen where train() would start.
    monkeypatch.setattr(recipe, "prepare", lambda *parsed: parsed[3])
    monkeypatch.setattr(recipe, "train", lambda grad_sync: print("save_on_signal", grad_sync.save_on_signal))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for argv, environment, expected in (
        ([], None, "SIGTERM"),
        ([], "SIGUSR1", "SIGUSR1"),
        (["--grad-sync-save-on-signal", "none"], "SIGUSR1", "none"),
    ):
        monkeypatch.delenv(ENV, raising=False)
        if environment is not None:
            monkeypatch.setenv(ENV, environment)
        recipe.run([*argv, "--output_dir", "/tmp/unused"])
        assert capsys.readouterr().out.strip().endswith(f"save_on_signal {expected}")
    helps = [a.help for a in recipe.make_parser()._actions if a.dest == "save_on_signal"]
    assert helps and "Default (this recipe): 'SIGTERM'" in helps[0]
    AcceleratorState._reset_state(reset_partial_state=True)  # GRPOConfig set it up while parsing
