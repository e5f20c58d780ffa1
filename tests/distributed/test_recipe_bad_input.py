"""Bad input to `accelerate launch ... recipes/grpo.py` on 2 CPU ranks: the launch stops before the
model is loaded and before output_dir exists, with one line naming the setting, printed once
(by the main process; the other rank is stopped by the launcher), never argparse's whole usage
on every rank."""

from __future__ import annotations

import shlex
import subprocess

import pytest
from launcher import REPO, recipe_launch

FSDP2 = "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py"
FSDP1 = "accelerate launch --config_file accelerate_configs/fsdp1.yaml recipes/grpo.py"

CASES = {
    "zero-micro-batches": (
        f"{FSDP2} --gradient_accumulation_steps 0",
        ["error: --gradient_accumulation_steps 0: must be >= 1 (micro-batches per optimizer step)."],
    ),
    "budget-on-fsdp1": (
        f"{FSDP1} --grad-sync-mode budget --grad-sync-memory-budget 1GiB",
        [
            "error: --grad-sync-mode budget (or --grad-sync-memory-budget 1GiB, which selects it): sync mode "
            "'budget' needs FSDP2 (per-unit requires_gradient_sync), but the model is wrapped in fsdp1."
        ],
    ),
    "defer-all-reduce-on-fsdp1": (
        f"{FSDP1} --grad-sync-mode defer_all_reduce",
        [
            "error: --grad-sync-mode defer_all_reduce: sync mode 'defer_all_reduce' needs FSDP2 "
            "(set_requires_all_reduce), but the model is wrapped in fsdp1."
        ],
    ),
    "defer-all-reduce-without-hsdp": (
        f"{FSDP2} --grad-sync-mode defer_all_reduce",
        ["error: --grad-sync-mode defer_all_reduce: sync mode 'defer_all_reduce' needs an HSDP mesh"],
    ),
    "unknown-mode": (
        f"{FSDP2} --grad-sync-mode nonsense",
        [
            "invalid choice: 'nonsense' (choose from 'per_micro_batch', 'deferred', 'auto', 'budget', "
            "'defer_all_reduce')",
            "See `python recipes/grpo.py --help` for every setting.",
        ],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_stops_the_launch_with_one_line_before_anything_is_written(name, tmp_path):
    command, lines = CASES[name]
    out_dir = tmp_path / "output"
    cmd, env = recipe_launch([*shlex.split(command)[2:], "--output_dir", str(out_dir)])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "exitcode  : 2" in output  # the main process's setting error, not a crash or a signal
    for line in lines:
        assert output.count(line) == 1, output[-4000:]
    assert "usage:" not in output  # not argparse's 200 lines, once per rank
    assert "grad sync:" not in output  # attach never ran: no model was built
    assert not out_dir.exists()


def test_max_restarts_with_a_rendezvous_that_cannot_restart_is_refused_at_start(tmp_path):
    """accelerate's default rendezvous (static) shares the launcher's store across restarts, so a
    restarted group could not form: refused before training, by each attempt's main process."""
    out_dir = tmp_path / "output"
    cmd, env = recipe_launch(["--max_restarts", "1", *shlex.split(FSDP2)[2:], "--output_dir", str(out_dir)])
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = (
        "error: accelerate launch --max_restarts 1: a restarted group cannot form with the launcher's shared "
        "rendezvous store"
    )
    assert output.count(line) == 2, output[-4000:]  # the first attempt and the one restart
    assert not out_dir.exists()
