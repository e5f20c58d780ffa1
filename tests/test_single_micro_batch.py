"""With one micro-batch per optimizer step every micro-batch syncs, so no mode holds
anything: the decision line and every estimate row say so (0 held, same peak as per_micro_batch)."""

import re

import pytest

from accel_gradsync import GradSyncConfig
from accel_gradsync.decision import describe_decision
from accel_gradsync.estimate import (
    build_meta_model,
    estimate,
    estimated_adapter,
    load_model_config,
    read_accelerate_config,
)
from accel_gradsync.policies import POLICIES

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.errors.GradSyncWarning")

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
    plan = POLICIES[name](CONFIG).plan(adapter, lambda: 2**30, 4)
    assert plan.held  # with more micro-batches this mode would hold something
    line = describe_decision(plan, adapter, 1)
    assert line.startswith(f"grad sync: {plan.mode} over 1 micro-batch")
    assert f"({len(adapter.units)} per-micro-batch)" in line
    assert "one micro-batch per optimizer step" in line and "nothing to defer" in line
    assert "holds ~" not in line and "B held" not in line, line  # no bytes held, also not in the reason
    assert re.search(rf"-> {len(adapter.units)} reduce-scatters, {len(adapter.units)} all-reduces", line), line


def test_every_estimate_row_holds_nothing_with_one_micro_batch():
    est = estimate("recipe-default", FSDP2_HSDP, 1, CONFIG)
    rows = [m for m in est.modes if m.applicable]
    assert len(rows) == len(POLICIES) + 1  # and the deferred+window row
    per_mb = est.mode("per_micro_batch")
    for row in rows:
        assert (row.units_held, row.held_bytes, row.held_dtype) == (0, 0, ""), row
        # Nothing held: each row costs exactly what syncing every micro-batch costs.
        assert (row.peak_bytes, row.sharded_bytes, row.send_bytes) == (
            per_mb.peak_bytes,
            per_mb.sharded_bytes,
            per_mb.send_bytes,
        ), row
        assert row.fits is True and row.all_gathers == per_mb.all_gathers, row
        assert "B held" not in row.reason, row


def test_cli_table_shows_zero_held_for_every_mode(tmp_path, capsys):
    from accel_gradsync.cli import main

    path = tmp_path / "fsdp2.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    )
    assert main(["estimate", "--accelerate-config", str(path), "--micro-batches", "1", "--defer-grad-sync"]) == 0
    table = capsys.readouterr().out
    deferred = re.search(r"^deferred \*\s+(\S+)\s+-\s+\S+ \S+\s+(\S+ \S+)\s", table, re.M)
    assert deferred and deferred.group(2) == "0 B", table
