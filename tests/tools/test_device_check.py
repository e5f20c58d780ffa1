"""tools/device_check.py, the one-GPU check no CI runs, run here with `--cpu`: its FSDP2 window on
gloo (no memory readings) must still run on the package's current internals and put every unit's
sync flags back, so a move of the modules it reads breaks this test, not the next run on a GPU. In the
compatibility suite: the FSDP2 internals it reads differ by torch release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.compat
def test_the_device_check_runs_its_fsdp2_window_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "MASTER_PORT": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "tools/device_check.py", "--cpu"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["device"] == "cpu" and out["flags_restored"] is True
    assert out["param_mib_fp32"] == 4 * (256 * 256 + 256) * 4 / 2**20  # 4 Linear(256, 256), fp32
