"""The chaos run (tools/chaos.py) for real: one fault per configuration (FSDP2 windowed, FSDP2
deferred, FSDP1 deferred), drawn from a fixed seed, each run ending byte-equal to its undisturbed
run. About 5 minutes on 2 cores, so --slow only; the figure in docs/recipe.md comes from a longer
run of the same script."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launcher import REPO


@pytest.mark.slow
def test_the_chaos_run_survives_a_fault_in_each_configuration(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/chaos.py", "--faults", "3", "--seed", "1", "--work_dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    summary = re.search(r"faults injected: (\d+), survived: (\d+), steps recomputed: (\d+)", output)
    assert summary is not None, output[-3000:]
    assert int(summary.group(1)) == int(summary.group(2)) == 3
