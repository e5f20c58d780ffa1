"""`estimator.formatting`: the table stars the selected mode and shows the n/a rows; --json prints
every row."""

import json
import re

import pytest
import yaml

from accel_gradsync.estimator.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")


def test_cli_prints_a_table_and_json(fsdp, tmp_path, capsys):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(yaml.safe_dump(fsdp(2, "bf16")))
    assert (
        main(
            [
                "estimate",
                "--accelerate-config",
                str(path),
                "--micro-batches",
                "4",
                "--grad-sync-reduce-dtype",
                "fp32",
                "--defer-grad-sync",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert re.search(r"^deferred \*\s+3\s", table, re.M)  # the selected mode is starred
    assert "fp32" in table and "n/a" in table
    assert main(["estimate", "--accelerate-config", str(path), "--micro-batches", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [m["mode"] for m in data["modes"]][:2] == ["per_micro_batch", "deferred"]
    assert data["modes"][1]["held_dtype"] == "bf16"  # accelerate's bf16: reduce = param dtype
