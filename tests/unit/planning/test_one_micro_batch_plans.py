"""With one micro-batch per optimizer step every micro-batch syncs, so no mode holds a gradient:
the decision line and every estimate row say so (0 held). A window is then that one micro-batch:
its units keep their params from forward to backward, which saves the backward's all-gathers and
costs the kept params; rows and lines without windows cost what per_micro_batch costs.
(Against a real 2-rank run: tests/distributed/test_one_micro_batch_window.py.)"""

import re

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.core import WINDOWED_ROW, estimate
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.planning.costs import format_bytes
from accel_gradsync.planning.policies import POLICIES
from accel_gradsync.runtime.core.decision import describe_decision

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")

FSDP2_HSDP = {
    "distributed_type": "FSDP",
    "num_processes": 4,
    "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
    "parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2},
}
CONFIG = GradSyncConfig(sync_mode="budget", free_memory="1GiB", memory_budget="200KiB", keep_params_unsharded=True)


@pytest.mark.parametrize("name", ["deferred", "budget", "defer_all_reduce", "auto"])
def test_decision_line_says_there_is_nothing_to_defer(name):
    adapter = estimated_adapter(
        build_meta_model(load_model_config("recipe-default")), read_accelerate_config(FSDP2_HSDP), CONFIG
    )
    plan = POLICIES[name](CONFIG.resolved()).plan(adapter, lambda: 2**30, 4)
    assert plan.held  # with more micro-batches this mode would hold something
    line = describe_decision(plan, adapter, 1)
    assert line.startswith(f"grad sync: {plan.mode} over 1 micro-batch")
    assert "one micro-batch per optimizer step" in line and "nothing to defer" in line
    assert "grads" not in line and "B held" not in line, line  # no gradient held, also not in the reason
    units = len(adapter.units)
    assert re.search(rf"-> {units} reduce-scatters, {units} all-reduces", line), line
    # Each unit gathers in its forward; one that reshards after forward gathers again in
    # backward, unless a window keeps its params from forward to backward.
    windowed = {id(u) for u in plan.windowed}
    gathers = sum(1 + (u.reshards_after_forward and id(u) not in windowed) for u in adapter.units)
    assert f" {gathers} all-gathers/step" in line, line
    if not windowed:
        assert f"({units} per-micro-batch)" in line and "keeps ~" not in line, line
        return
    assert f"{len(windowed)} windowed" in line, line
    kept = format_bytes(sum(u.param_bytes for u in plan.windowed))
    assert f"keeps ~{kept} unsharded float32 params per rank from each forward to its backward" in line, line


def test_every_estimate_row_holds_no_gradient_with_one_micro_batch():
    est = estimate("recipe-default", FSDP2_HSDP, 1, CONFIG)
    rows = [m for m in est.modes if m.applicable]
    assert len(rows) == len(POLICIES) + 1  # and the deferred+windowed row
    per_mb = est.mode("per_micro_batch")
    for row in rows:
        assert (row.units_held, row.held_bytes, row.held_dtype) == (0, 0, ""), row
        assert (row.sharded_bytes, row.send_bytes, row.reduce_scatters) == (
            per_mb.sharded_bytes,
            per_mb.send_bytes,
            per_mb.reduce_scatters,
        ), row
        assert row.fits is True and "B held" not in row.reason, row
        if row.mode != WINDOWED_ROW:  # nothing kept: exactly what syncing every micro-batch costs
            assert (row.peak_bytes, row.all_gathers, row.held_param_bytes) == (per_mb.peak_bytes, per_mb.all_gathers, 0)
    # The window keeps every unit's params from forward to backward: one all-gather per unit
    # (two layers reshard after forward and would gather again in backward), at their bytes.
    window = est.mode(WINDOWED_ROW)
    assert (len(est.units), window.all_gathers, per_mb.all_gathers) == (3, 3, 5)
    assert window.held_param_bytes == est.params * 4  # fp32, every parameter trainable
    assert window.peak_bytes == per_mb.peak_bytes + window.held_param_bytes


def test_cli_table_shows_zero_held_for_every_mode(tmp_path, capsys):
    from accel_gradsync.estimator.cli import main

    path = tmp_path / "fsdp2.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    )
    assert main(["estimate", "--accelerate-config", str(path), "--micro-batches", "1", "--defer-grad-sync"]) == 0
    table = capsys.readouterr().out
    deferred = re.search(r"^deferred \*\s+(\S+)\s+-\s+\S+ \S+\s+(\S+ \S+)\s", table, re.M)
    assert deferred and deferred.group(2) == "0 B", table
