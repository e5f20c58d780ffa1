"""`attach` in a single process: a no-op with one warning, and refusals of wrong targets."""

import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import accel_gradsync
from accel_gradsync import GradSyncConfig, GradSyncWarning


@pytest.fixture
def accelerator(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


def test_single_process_is_a_no_op_with_one_warning(accelerator):
    model = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(GradSyncWarning, match="single process") as record:
        handle = accel_gradsync.attach(accelerator, GradSyncConfig(defer=True))
    assert len(record) == 1
    assert type(accelerator) is Accelerator  # nothing hooked
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning per micro-batch
        for _ in range(4):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(2, 4)).sum())
    assert handle.stats()["micro_batches"] == 0
    handle.detach()


def test_attach_refuses_other_objects(accelerator):
    with pytest.raises(TypeError, match="Accelerator or a transformers.Trainer, got torch.nn.modules.linear.Linear"):
        accel_gradsync.attach(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="takes a GradSyncConfig"):
        accel_gradsync.attach(accelerator, {"defer": True})


def test_enable_cpu_fsdp_does_nothing_without_an_fsdp_launch(accelerator):
    assert accel_gradsync.enable_cpu_fsdp() is False


def test_attach_refuses_fewer_than_one_micro_batch_per_step(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=0)  # accelerate takes it as is
        with pytest.raises(ValueError, match=r"Accelerator\(gradient_accumulation_steps=...\)=0: must be >= 1"):
            accel_gradsync.attach(accelerator, GradSyncConfig(defer=True))
        assert type(accelerator) is Accelerator  # nothing hooked
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_attach_refuses_a_trainer_with_zero_gradient_accumulation_steps(monkeypatch, tmp_path):
    from transformers import Trainer, TrainingArguments

    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), gradient_accumulation_steps=0, use_cpu=True, report_to="none"
        )
        trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
        with pytest.raises(ValueError, match=r"TrainingArguments.gradient_accumulation_steps=0: must be >= 1"):
            accel_gradsync.attach(trainer, GradSyncConfig(defer=True))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
