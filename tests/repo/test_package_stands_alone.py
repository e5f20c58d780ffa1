"""The package stands alone: a copy of `accel_gradsync/` without the repository around it imports
without the recipe's libraries (TRL, datasets, PEFT) and runs the estimate of the recipe's
built-in model, so nothing in it reads `recipes/` or needs the `recipes` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import accel_gradsync, accel_gradsync.estimator.cli, accel_gradsync.estimator.core
assert accel_gradsync.__file__.startswith(sys.argv[1]), accel_gradsync.__file__
loaded = sorted(m for m in ("trl", "datasets", "peft", "recipes", "embedded") if m in sys.modules)
assert not loaded, loaded
est = accel_gradsync.estimator.core.estimate(
    "recipe-default", {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}, 4
)
print(est.params, len(est.units))
"""


def test_a_copy_of_the_package_alone_imports_and_estimates(tmp_path):
    shutil.copytree(REPO / "accel_gradsync", tmp_path / "accel_gradsync", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    params, units = map(int, proc.stdout.split())
    assert params > 0 and units >= 2
