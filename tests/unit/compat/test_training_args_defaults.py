"""`training_args_defaults()`: the TrainingArguments defaults a machine with no GPU/NPU needs, and
the refusal where an FSDP launch there has not called `enable_cpu_fsdp()` yet. The 2-process
launch that uses them (FSDP state kept by the Trainer) is
tests/distributed/test_readme_scripts.py's TRL script."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import accel_gradsync
from accel_gradsync.compat.cpu import has_accelerator_device, training_args_defaults

pytestmark = pytest.mark.skipif(has_accelerator_device(), reason="what a machine with no GPU/NPU needs")

LAUNCH = ("ACCELERATE_USE_FSDP", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)


def test_it_is_public():
    assert "training_args_defaults" in accel_gradsync.__all__
    assert accel_gradsync.training_args_defaults is training_args_defaults


def test_without_a_device_bf16_and_pinned_memory_are_off():
    assert training_args_defaults() == {"bf16": False, "dataloader_pin_memory": False}


def test_a_single_process_fsdp_config_needs_no_fsdp_state(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "1")  # enable_cpu_fsdp() does nothing for one process
    assert training_args_defaults() == {"bf16": False, "dataloader_pin_memory": False}


def test_an_fsdp_launch_before_enable_cpu_fsdp_is_refused_naming_the_call(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError) as error:
        training_args_defaults()
    message = str(error.value)
    assert "ACCELERATE_USE_FSDP=true, WORLD_SIZE=2" in message
    assert "call it first, before parsing" in message and "accel_gradsync.enable_cpu_fsdp()" in message


GRPO_CONFIG = """
import sys, accel_gradsync
from trl import GRPOConfig
try:
    GRPOConfig(output_dir=sys.argv[1])
except ValueError as error:
    print("refused:", error)
args = GRPOConfig(output_dir=sys.argv[1], **accel_gradsync.training_args_defaults())
print("built:", args.bf16, args.dataloader_pin_memory)
"""


def test_trls_config_is_refused_without_them_and_builds_with_them(tmp_path):
    """The README's failure, in a fresh interpreter (the config builds accelerate's state):
    GRPOConfig's bf16 default is refused here; with the defaults it builds, bf16 and pinning off."""
    pytest.importorskip("trl")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    proc = subprocess.run(
        [sys.executable, "-c", GRPO_CONFIG, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, built = proc.stdout.strip().splitlines()
    assert refused.startswith("refused: Your setup doesn't support bf16/gpu"), refused
    assert built == "built: False False"
