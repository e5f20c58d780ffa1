"""`estimator.cli` (`accel-gradsync estimate`, `python -m accel_gradsync`): errors exit 2 with one
line and no traceback; negative sizes say they must be >= 0; defer accepts the ints 0 and 1 as it
accepts "0" and "1"; the console script and the module print the help."""

import runpy
import shutil
import subprocess
import sys

import pytest

from accel_gradsync.estimator.cli import main

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning"),
]


@pytest.mark.parametrize("flag", ["--grad-sync-memory-budget", "--grad-sync-free-memory"])
@pytest.mark.parametrize("joined", [False, True])
def test_negative_sizes_on_the_command_line_must_be_at_least_zero(cli_error, good, capsys, flag, joined):
    size = [f"{flag}=-1GiB"] if joined else [flag, "-1GiB"]  # argparse reads a lone -1GiB as an option
    line = cli_error(capsys, "--accelerate-config", good, *size)
    assert "='-1GiB'" in line and "must be >= 0" in line, line


def test_the_real_command_exits_2_with_one_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: [unclosed\n")
    out = subprocess.run(
        [sys.executable, "-m", "accel_gradsync", "estimate", "--accelerate-config", str(path), "--micro-batches", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.rstrip("\n").splitlines()[-1].startswith("accel-gradsync estimate: error: ")


def test_cli_errors_exit_2_with_the_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--accelerate-config", str(tmp_path / "none.yaml"), "--micro-batches", "4"])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_console_script_and_module_help(monkeypatch, capsys):
    script = shutil.which("accel-gradsync")
    if script is None:
        pytest.skip("console script not installed (pip install -e .)")
    out = subprocess.run([script, "estimate", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--accelerate-config", "--micro-batches", "--grad-sync-free-memory", "--json", "--defer-grad-sync"):
        assert flag in out.stdout
    monkeypatch.setattr(sys, "argv", ["python -m accel_gradsync", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("accel_gradsync", run_name="__main__")
    assert exit_info.value.code == 0 and "estimate" in capsys.readouterr().out
