"""`accel-gradsync estimate --torch`: the estimate names the torch it assumes, plans with that
release's FSDP2 dtype rules (a real `fully_shard` on the meta device in a fake process group, read
by the run's adapter), refuses a release it is not tested on in one line, and says where the step
peak is this process's torch's rather than the cluster's."""

import json

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accel_gradsync.compat.fsdp2 import torch_series
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.fake_shard import fake_world
from accel_gradsync.runtime.wrappers.adapt import adapt_model

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning"),
]
HERE = torch_series(torch.__version__)
OTHER = "2.14" if HERE == "2.15" else "2.15"


def _json(capsys, *args: str) -> dict:
    main(["estimate", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_estimate_names_the_torch_it_assumes(good, capsys):
    est = _json(capsys, "--accelerate-config", good, "--micro-batches", "2")
    assert (est["torch"], est["torch_running"]) == (HERE, torch.__version__)
    est = _json(capsys, "--accelerate-config", good, "--micro-batches", "2", "--torch", OTHER)
    assert (est["torch"], est["torch_running"]) == (OTHER, torch.__version__)
    main(["estimate", "--accelerate-config", good, "--micro-batches", "2", "--torch", OTHER])
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(f"torch {OTHER}'s dtype rules (this process runs torch {torch.__version__})"), header


def test_a_release_it_is_not_tested_on_is_refused_naming_the_choices(cli_error, good, capsys):
    line = cli_error(capsys, "--accelerate-config", good, "--torch", "2.12")
    assert "--torch" in line and "'2.12'" in line and "'2.13', '2.14', '2.15'" in line, line


@pytest.mark.parametrize(
    ("release", "held"), [("2.13", torch.bfloat16), ("2.14", torch.bfloat16), ("2.15", torch.float32)]
)
def test_a_policy_without_a_reduce_dtype_holds_what_the_release_holds(release, held):
    """fp32 params, bf16 compute, no reduce dtype: 2.13 and 2.14 hold and reduce-scatter bf16 (2
    bytes/param), 2.15 the parameter's fp32 (4), whatever torch shards the model here. With a
    reduce dtype every release holds it."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to("meta")
    with fake_world(2):
        fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        adapter = adapt_model(model, release)
    layer, root = adapter.units[1], adapter.units[0]  # forward order: the root first
    assert (layer.held_dtype, layer.reduce_dtype, layer.compute_dtype) == (held, held, torch.bfloat16)
    assert layer.held_bytes == (8 * 8 + 8) * held.itemsize
    assert (root.held_dtype, root.reduce_dtype) == (torch.float32, torch.float32)


def test_a_step_peak_for_another_release_says_it_is_this_torchs(good, capsys):
    args = ["--accelerate-config", good, "--micro-batches", "2", "--micro-batch-size", "1", "--seq-len", "8"]
    here = _json(capsys, *args)
    other = _json(capsys, *args, "--torch", OTHER)
    for mine, theirs in zip(here["modes"], other["modes"], strict=True):
        if mine["step_peak_bytes"] is None:
            continue
        assert not any("not by the cluster's" in note for note in mine["step_peak_unmodeled"])
        assert any(f"this process's torch {torch.__version__}" in n for n in theirs["step_peak_unmodeled"])
        # accelerate's policy names a reduce dtype, so both releases hold the same bytes.
        assert (theirs["step_peak_bytes"], theirs["held_bytes"]) == (mine["step_peak_bytes"], mine["held_bytes"])
