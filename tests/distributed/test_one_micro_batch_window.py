"""One micro-batch per optimizer step on real 2-rank gloo FSDP2: the window has nothing to defer,
but it still keeps the units' parameters unsharded from each forward to its backward, so the
backward gathers nothing. The decision line, the handle's counters and the estimate say what
runs: the all-gathers and reduce-scatters of each step, counted from outside, and the parameter
bytes kept between forward and backward, read from FSDP's own state."""

import re

import pytest
from launcher import accelerate_config, launch

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.core import estimate
from accel_gradsync.planning.costs import format_bytes

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")
CONFIG = accelerate_config("fsdp2", fsdp_transformer_layer_cls_to_wrap="Qwen2DecoderLayer")
SETTINGS = {
    "per_micro_batch": GradSyncConfig(sync_mode="per_micro_batch"),
    "deferred+windowed": GradSyncConfig(sync_mode="deferred", keep_params_unsharded=True),
}


@pytest.fixture(scope="module")
def run():
    ranks = launch("one_micro_batch", ["--steps", "3"], CONFIG)
    rows = {mode: estimate("recipe-default", CONFIG, 1, config).mode(mode) for mode, config in SETTINGS.items()}
    return ranks, rows


def _results(run):
    ranks, rows = run
    for rank in ranks:
        for result in rank["results"]:
            yield result, rows[result["mode"]]


def test_counts_of_each_step_are_what_ran(run):
    for result, row in _results(run):
        line, stats = result["decision"], result["stats"]
        said = re.search(r"-> (\d+) reduce-scatters and (\d+) all-gathers/step", line)
        assert said, line
        for step in result["steps"]:
            counts = step["counts"]
            gathers = counts.get("all_gather_into_tensor", 0) + counts.get("all_gather_single", 0)
            scatters = counts.get("reduce_scatter_tensor", 0) + counts.get("reduce_scatter_single", 0)
            assert (gathers, scatters) == (row.all_gathers, row.reduce_scatters), (result["mode"], counts, row)
            assert (int(said.group(2)), int(said.group(1))) == (gathers, scatters), line
        assert (stats["last_step/all_gathers"], stats["last_step/reduce_scatters_issued"]) == (
            row.all_gathers,
            row.reduce_scatters,
        ), stats
        assert stats["optimizer_steps"] == len(result["steps"])


def test_windowed_gathers_each_unit_once_per_step_and_says_what_it_keeps(run):
    ranks, rows = run
    window, per_micro_batch = rows["deferred+windowed"], rows["per_micro_batch"]
    units = 3  # two decoder layers, and the group of embeddings, final norm and tied head
    # Two layers reshard after forward and gather again in backward; the window keeps them.
    assert (per_micro_batch.all_gathers, window.all_gathers) == (units + 2, units)
    assert window.held_bytes == 0 and window.held_param_bytes > 0  # nothing deferred, params kept
    assert window.peak_bytes == per_micro_batch.peak_bytes + window.held_param_bytes
    for result, row in _results(run):
        if result["mode"] != "deferred+windowed":
            continue
        for step in result["steps"]:
            assert step["kept_param_bytes"] == row.held_param_bytes, (step, row)
            assert step["after_step"] == 0  # the backward reshards: nothing kept into the next step
        line = result["decision"]
        assert f"({units} windowed)" in line, line
        assert f"~{format_bytes(row.held_param_bytes)} unsharded float32 params" in line, line
        assert "grads" not in line.split("->")[1].split(";")[1], line  # no gradient is held


def test_per_micro_batch_keeps_only_the_root_group(run):
    ranks, rows = run
    for result, row in _results(run):
        if result["mode"] != "per_micro_batch":
            continue
        assert row.held_param_bytes == 0
        for step in result["steps"]:
            assert 0 < step["kept_param_bytes"] < rows["deferred+windowed"].held_param_bytes
