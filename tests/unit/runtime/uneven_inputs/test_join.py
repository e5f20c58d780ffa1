"""`grad_sync.join()` in one process: what its shadow records and replays (inputs detached, the
tensors of a model's output), a loop inside it on one process
(nothing to pair: it runs as without it) and its refusal on a Trainer. The multi-rank protocol
(uneven counts in every mode, the refusals on every rank) is in tests/distributed/test_uneven_inputs.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

import accel_gradsync
from accel_gradsync import GradSyncConfig
from accel_gradsync.runtime.uneven_inputs.join_record import _detached, tensors_of


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_recorded_inputs_are_detached_and_keep_their_structure():
    leaf = torch.ones(2, requires_grad=True)
    made = leaf * 2  # carries a graph
    recorded = _detached(((made, 3), {"mask": made, "labels": [made, "keep"]}))
    (t, n), kwargs = recorded
    assert not t.requires_grad and t.grad_fn is None and n == 3
    assert not kwargs["mask"].requires_grad and kwargs["labels"][1] == "keep"
    assert torch.equal(kwargs["labels"][0], made.detach())


def test_the_outputs_scaled_by_zero_are_every_tensor_of_a_model_output():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    # A transformers ModelOutput is a dict; a tuple of (loss, logits); nested lists.
    assert [t.numel() for t in tensors_of({"loss": a, "logits": b, "hidden": (c, None)})] == [1, 2, 3]
    assert tensors_of(None) == [] and tensors_of("text") == []
    assert [t.numel() for t in tensors_of([a, [b, {"x": c}]])] == [1, 2, 3]


def test_one_process_trains_inside_join_as_without_it():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "accel_gradsync: single process")
        grad_sync = accel_gradsync.attach(accelerator, GradSyncConfig(defer=True))
    before = model.weight.detach().clone()
    with grad_sync.join():
        for _ in range(3):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(2, 4)).sum())
                optimizer.step()
                optimizer.zero_grad()
    assert not torch.equal(model.weight, before)


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.linear(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def test_a_trainer_is_refused_in_one_line(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no")
    trainer = Trainer(model=Regression(), args=args, train_dataset=[{"x": torch.randn(4), "labels": torch.randn(())}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: attach says there is no sync to schedule
        grad_sync = accel_gradsync.attach(trainer, GradSyncConfig())
    refusal = "a Trainer gives every rank the same number of micro-batches"
    with pytest.raises(ValueError, match=refusal) as refused, grad_sync.join():
        pass
    assert "\n" not in str(refused.value)
