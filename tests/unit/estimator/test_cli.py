"""`estimator.cli` (`accel-gradsync estimate`, `python -m accel_gradsync`): errors exit 2 with one
line and no traceback; negative sizes say they must be >= 0; defer accepts the ints 0 and 1 as it
accepts "0" and "1"; the console script and the module print the help."""

import json
import os
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
    from importlib.metadata import entry_points
    from pathlib import Path

    # pip puts it beside the interpreter (a venv's bin/, whether or not that is on PATH).
    beside = Path(sys.executable).with_name("accel-gradsync")
    script = str(beside) if beside.is_file() else shutil.which("accel-gradsync")
    if script is None:
        assert not entry_points(group="console_scripts", name="accel-gradsync"), (
            f"accel-gradsync is installed but its console script is neither beside {sys.executable} nor on PATH"
        )
        pytest.skip("accel-gradsync is not installed (pip install -e .)")
    out = subprocess.run([script, "estimate", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--accelerate-config", "--micro-batches", "--grad-sync-free-memory", "--json", "--defer-grad-sync"):
        assert flag in out.stdout
    monkeypatch.setattr(sys, "argv", ["python -m accel_gradsync", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("accel_gradsync", run_name="__main__")
    assert exit_info.value.code == 0 and "estimate" in capsys.readouterr().out


SHAPE = ["--micro-batch-size", "2", "--seq-len", "32"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ([*SHAPE, "--max-completion-length", "16", "--num-generations", "-2"], "--num-generations=-2"),
        ([*SHAPE, "--max-completion-length", "16", "--num-generations", "0"], "--num-generations=0"),
        ([*SHAPE, "--max-completion-length", "0", "--num-generations", "3"], "--max-completion-length=0"),
        (["--lora-r", "0"], "--lora-r=0"),
        (["--lora-r", "-4"], "--lora-r=-4"),
    ],
)
def test_a_count_below_one_is_refused_naming_the_flag_and_its_value(cli_error, good, capsys, args, named):
    """Given is given: 0 is not read as "unset", and a flag that was passed is not called missing."""
    line = cli_error(capsys, "--accelerate-config", good, *args)
    assert named in line and "at least 1" in line and "neither" not in line, line


# A refusal in a process of its own: what it printed, and which heavy modules it had imported by then.
_REFUSE = """
import json, sys
from accel_gradsync.estimator.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = ("accelerate", "peft", "torch.distributed.fsdp", "transformers.modeling_utils", "accel_gradsync.estimator.core")
imported = [m for m in heavy if m in sys.modules]
import accel_gradsync._attach  # the submodule, then the package's function: `attach` stays the function
import accel_gradsync
assert callable(accel_gradsync.attach) and callable(accel_gradsync.estimate)
print(json.dumps({"code": code, "imported": imported}))
"""


def test_a_refusal_is_two_lines_checked_before_the_model_machinery_is_imported(good):
    args = ["estimate", "--accelerate-config", good, "--micro-batches", "2", "--lora-r", "-4"]
    out = subprocess.run([sys.executable, "-c", _REFUSE, *args], capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, out.stderr
    lines = out.stderr.rstrip("\n").splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: accel-gradsync estimate "), out.stderr
    assert lines[1].startswith("accel-gradsync estimate: error: --lora-r=-4"), out.stderr
    assert result["imported"] == [], result  # nothing that builds or shards a model before the flags are read


def test_lora_on_a_model_transformers_shards_is_refused_in_one_line(cli_error, capsys):
    """PEFT adds the adapter after transformers sharded the base: no FSDP unit trains, nothing to plan."""
    line = cli_error(capsys, "--distributed-config", '{"fsdp_size": 2}', "--micro-batches", "4", "--lora-r", "8")
    assert "--lora-r=8" in line and "--distributed-config" in line and "--accelerate-config" in line, line


# Numbers have an upper bound, said in the refusal: far above any launch, low enough that every
# count the estimate multiplies stays an honest integer and the fake sharding ends in seconds.
TWENTY_ONE_DIGITS = "9" * 21


@pytest.mark.parametrize(
    ("args", "named", "bound"),
    [
        (["--micro-batches", TWENTY_ONE_DIGITS], f"--micro-batches={TWENTY_ONE_DIGITS}", "1,000,000,000,000"),
        (["--micro-batches", str(10**12 + 1)], f"--micro-batches={10**12 + 1}", "1,000,000,000,000"),
        (["--num-processes", TWENTY_ONE_DIGITS], f"--num_processes={TWENTY_ONE_DIGITS}", "100,000"),
        (["--num-processes", "100001"], "--num_processes=100001", "100,000"),
        (["--micro-batch-size", "100001", "--seq-len", "8"], "--micro-batch-size=100001", "100,000"),
        (["--micro-batch-size", "1", "--seq-len", "10000001"], "--seq-len=10000001", "10,000,000"),
        (["--lora-r", "100001"], "--lora-r=100001", "100,000"),
    ],
)
def test_a_count_above_its_bound_is_refused_saying_the_bound(cli_error, good, capsys, args, named, bound):
    line = cli_error(capsys, "--accelerate-config", good, *args)
    assert named in line and f"at most {bound}" in line, line


def test_a_micro_batch_count_at_the_bound_is_estimated(good, capsys):
    assert main(["estimate", "--accelerate-config", good, "--micro-batches", str(10**12), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["mode"]: row for row in result["modes"]}
    # per_micro_batch reduce-scatters every unit at every micro-batch, deferred once per step.
    assert rows["per_micro_batch"]["reduce_scatters"] == 10**12 * rows["deferred"]["reduce_scatters"] > 0


def _estimate(*args: str) -> subprocess.CompletedProcess:
    """The real command, offline, as a user runs it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "accel_gradsync", "estimate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_the_real_command_refuses_a_21_digit_count_before_importing_the_model_machinery(good):
    args = ["estimate", "--accelerate-config", good, "--micro-batches", TWENTY_ONE_DIGITS]
    out = subprocess.run([sys.executable, "-c", _REFUSE, *args], capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 2, "imported": []}, (result, out.stderr)
    lines = out.stderr.rstrip("\n").splitlines()
    assert len(lines) == 2 and f"--micro-batches={TWENTY_ONE_DIGITS}" in lines[1], out.stderr


def test_the_real_command_says_no_such_directory_for_a_missing_model_path(good):
    out = _estimate("--accelerate-config", good, "--micro-batches", "2", "--model", "/no/such/path")
    lines = out.stderr.rstrip("\n").splitlines()
    assert out.returncode == 2 and len(lines) == 2 and lines[0].startswith("usage: "), out.stderr
    assert lines[1].startswith("accel-gradsync estimate: error: --model '/no/such/path': no such directory"), lines
    assert out.stdout == "", out.stdout


def test_the_real_command_names_an_unknown_model_type_in_one_line(good, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "nosuchmodel"}')
    out = _estimate("--accelerate-config", good, "--micro-batches", "2", "--model", str(tmp_path))
    lines = out.stderr.rstrip("\n").splitlines()
    assert out.returncode == 2 and len(lines) == 2 and "model_type='nosuchmodel'" in lines[1], out.stderr


# --json: a refusal is also an object on stdout, {"error": <the error line's message>}, so a script
# reading stdout as JSON gets JSON either way; the exit code is 2 and stderr keeps its two lines.


def _json_error(out: subprocess.CompletedProcess | tuple[str, str]) -> tuple[dict, str]:
    stdout, stderr = (out.stdout, out.stderr) if isinstance(out, subprocess.CompletedProcess) else out
    message = stderr.rstrip("\n").splitlines()[-1].removeprefix("accel-gradsync estimate: error: ")
    return json.loads(stdout), message


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "/no/such/path"],  # refused by the estimate
        ["--micro-batches", TWENTY_ONE_DIGITS],  # refused by the bounds, before the estimate
        ["--micro-batches", "many"],  # refused by argparse: not an int
        ["--no-such-flag", "1"],  # refused by argparse: unknown
        ["--mixed-precision", "fp64"],  # refused by argparse: not a choice
    ],
)
def test_with_json_a_refusal_is_an_error_object_on_stdout(good, args):
    out = _estimate("--json", "--accelerate-config", good, "--micro-batches", "2", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    error, message = _json_error(out)
    assert error == {"error": message}, (error, message)


@pytest.mark.parametrize("flags", [["--json", "true"], ["--json=true"], ["--json", "yes"]])
def test_json_given_a_value_is_read_as_the_parser_reads_it(good, capsys, flags):
    with pytest.raises(SystemExit):
        main(["estimate", *flags, "--accelerate-config", good, "--micro-batches", "0"])
    error, message = _json_error(capsys.readouterr())
    assert error == {"error": message} and "--micro-batches=0" in message, error


def test_without_json_or_with_json_false_a_refusal_prints_nothing_on_stdout(good, capsys):
    for flags in ([], ["--json", "false"]):
        with pytest.raises(SystemExit):
            main(["estimate", *flags, "--accelerate-config", good, "--micro-batches", "0"])
        assert capsys.readouterr().out == "", flags


def test_help_says_how_errors_come_out_with_json(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert '{"error": ' in text and "exit 2" in text, text
