"""`accel-gradsync estimate` under every pair of its flags' values (a pairwise sweep: each value of
each flag meets each value of every other flag in at least one run): each run either prints an
estimate (JSON and table) that holds what the modes mean, or exits 2 with one error line naming
what it gave (and, as every run asks for --json, that line as an error object on stdout); none ends
in a traceback.

What a printed estimate must hold comes from the modes' definitions, not from the package's plan:
per_micro_batch reduce-scatters every trained unit at every micro-batch and holds nothing, deferred
once per step holding the whole unsharded gradient, the row selected is the mode asked for, a row
that does not apply says why, and stock TRL gathers a reference model at each micro-batch's
log-prob forward.
"""

import json

import pytest
import yaml

from accel_gradsync.config.settings import SYNC_MODES
from accel_gradsync.estimator.cli import main

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
WINDOWED = "deferred+windowed"

# Each flag's values; None: the flag left out. Flags read only together are one entry here
# (`--forecast`: the step forecast's shape flags; `--launch`: an accelerate config or
# transformers' DistributedConfig), and `--defer` is a value of the mode it is shorthand for, so
# that most runs estimate (each refusal alone is tested by name in test_cli.py, test_step_peak.py).
SPACE: dict[str, list] = {
    "--grad-sync-mode": [None, "per_micro_batch", "deferred", "--defer", "budget", "auto", "defer_all_reduce"],
    "--launch": ["fsdp2", "fsdp1", "hsdp", "transformers"],
    "--micro-batches": ["4", "1"],
    "--forecast": [None, "step", "step+sgd+checkpointing", "step+generation"],
    "--grad-sync-memory-budget": ["1MiB", "0.5", None],
    "--grad-sync-reduce-dtype": [None, "bf16", "fp32"],
    "--grad-sync-keep-reference-unsharded": [None, "true", "false"],
    "--num-processes": [None, "1"],
    "--mixed-precision": [None, "bf16"],
    "--model-dtype": [None, "bf16"],
    "--lora-r": [None, "4"],
    "--beta": [None, "0.04"],
    "--grad-sync-free-memory": [None, "8GiB"],
    "--grad-sync-keep-params-unsharded": [None, "true"],
    "--grad-sync-gather-for-generation": [None, "true"],
}
FORECASTS = {
    "step": ["--micro-batch-size", "2", "--seq-len", "32"],
    "step+sgd+checkpointing": ["--micro-batch-size", "2", "--seq-len", "32", "--optimizer", "sgd"]
    + ["--gradient-checkpointing", "true"],
    "step+generation": ["--micro-batch-size", "2", "--seq-len", "32", "--max-completion-length", "8"]
    + ["--num-generations", "2"],
}

ACCELERATE_CONFIGS = {
    "fsdp2": {"num_processes": 2, "fsdp_version": 2},
    "fsdp1": {"num_processes": 2, "fsdp_version": 1},
    "hsdp": {"num_processes": 4, "fsdp_version": 2, "replicate": 2},
}


def pairwise(space: dict[str, list]) -> list[dict]:
    """Runs covering every pair of values of two flags: each run starts from a pair not yet
    covered and takes, flag by flag, the value that covers most new pairs (deterministic)."""
    names = list(space)
    uncovered = {
        (a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1 :] for va in space[a] for vb in space[b]
    }
    runs = []
    while uncovered:
        a, va, b, vb = min(uncovered, key=lambda p: (names.index(p[0]), names.index(p[2]), str(p[1]), str(p[3])))
        run = {a: va, b: vb}
        for name in names:
            if name not in run:
                run[name] = max(
                    space[name], key=lambda v: sum((n, run[n], name, v) in uncovered for n in names if n in run)
                )
        run = {name: run[name] for name in names}
        uncovered -= {(x, run[x], y, run[y]) for i, x in enumerate(names) for y in names[i + 1 :]}
        runs.append(run)
    return runs


RUNS = pairwise(SPACE)


def argv_of(run: dict, config_dir) -> list[str]:
    argv = ["estimate", "--json"]
    for flag, value in run.items():
        if value is None:
            continue
        if flag == "--launch" and value == "transformers":
            argv += ["--distributed-config", '{"fsdp_size": 2}']
        elif flag == "--launch":
            spec = ACCELERATE_CONFIGS[value]
            keys = {
                "distributed_type": "FSDP",
                "num_processes": spec["num_processes"],
                "fsdp_config": {
                    "fsdp_version": spec["fsdp_version"],
                    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                },
            }
            if "replicate" in spec:
                keys["parallelism_config"] = {
                    "parallelism_config_dp_replicate_size": spec["replicate"],
                    "parallelism_config_dp_shard_size": spec["num_processes"] // spec["replicate"],
                }
            path = config_dir / f"{value}.yaml"
            path.write_text(yaml.safe_dump(keys))
            argv += ["--accelerate-config", str(path)]
        elif flag == "--forecast":
            argv += FORECASTS[value]
        elif value == "--defer":
            argv += ["--defer", "true"]
        else:
            argv += [flag, value]
    return argv


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def check_refusal(out: str, err: str, argv: list[str]) -> None:
    """One error line after the usage line, naming a setting or file the run gave; under --json
    the same message as an error object on stdout."""
    assert "Traceback" not in err, err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("accel-gradsync estimate: error: "), err
    assert err.count("error:") == 1, err
    assert json.loads(out) == {"error": last.removeprefix("accel-gradsync estimate: error: ")}, out
    names = {arg for arg in argv if arg.endswith(".yaml")}
    for arg in argv:
        if arg.startswith("--") and arg != "--json":
            name = arg[2:].removeprefix("grad-sync-")
            names |= {name, name.replace("-", "_")}
    names |= {"sync_mode"} if "defer" in names else set()  # --defer is shorthand for the mode
    names |= {"accelerate config"} if "accelerate-config" in names else set()  # a key to set in it
    assert any(name in last for name in names), (last, sorted(names))


def check_estimate(result: dict, run: dict) -> None:
    # A row is named by its mode, `auto -> deferred` by what auto chose; deferral is shown without
    # and with every unit windowed (`keep_params_unsharded`) whatever was asked.
    rows = {row["mode"].split(" ")[0]: row for row in result["modes"]}
    assert len(rows) == len(result["modes"]) and sorted(rows) == sorted([*SYNC_MODES, WINDOWED]), rows.keys()
    # A memory budget alone asks for budget mode, as a mode flag would (docs/modes.md).
    default = "budget" if run["--grad-sync-memory-budget"] else "per_micro_batch"
    asked = {None: default, "--defer": "deferred"}.get(run["--grad-sync-mode"], run["--grad-sync-mode"])
    if asked == "deferred" and run["--grad-sync-keep-params-unsharded"]:
        asked = WINDOWED
    assert [mode for mode, row in rows.items() if row["selected"]] == [asked]
    for mode, row in rows.items():
        assert row["applicable"] or row["reason"], mode  # a row that does not apply says why
    m = result["micro_batches"]
    assert m == int(run["--micro-batches"])
    every, once = rows["per_micro_batch"], rows["deferred"]
    if result["num_processes"] == 1:  # one rank: nothing to sync whatever the mode
        assert all(row["reduce_scatters"] == row["all_reduces"] == 0 for row in rows.values()), rows
    elif every["applicable"] and once["applicable"]:
        # Every trained unit reduces at every micro-batch, against once per step.
        assert every["reduce_scatters"] == m * once["reduce_scatters"] > 0
        assert every["all_reduces"] == m * once["all_reduces"]
        assert every["held_bytes"] == 0
        if run["--lora-r"] is None and m > 1:  # the whole model trains: its whole gradient is held
            assert once["held_bytes"] == result["params"] * DTYPE_BYTES[once["held_dtype"]]
    if result.get("step_shape"):
        for mode, row in rows.items():
            if row["applicable"]:
                assert row["step_peak_bytes"] >= row["step_peak_parts"]["sharded_params"] > 0, mode
    reference = result.get("reference")
    if reference and not reference["policy_adapter_off"]:
        # Stock TRL: one log-prob forward per micro-batch, each gathering every unit.
        assert reference["stock_all_gathers_per_step"] == m * reference["units"] > 0
        if reference["resident"]:
            assert reference["all_gathers_per_step"] == 0
            assert reference["first_step_all_gathers"] == reference["units"]


def test_the_sweep_covers_every_pair_in_few_runs():
    names = list(SPACE)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            seen = {(run[a], run[b]) for run in RUNS}
            assert len(seen) == len(SPACE[a]) * len(SPACE[b]), (a, b)
    assert len(RUNS) <= 40, len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=[f"run{i}" for i in range(len(RUNS))])
def test_every_pair_of_flags_estimates_or_refuses_in_one_line(run, tmp_path, capsys, clean_env):
    argv = argv_of(run, tmp_path)
    code, out, err = run_cli(argv, capsys)
    assert code in (0, 2), (argv, code, err[-3000:])
    if code == 2:
        check_refusal(out, err, argv)
        return
    result = json.loads(out)
    check_estimate(result, run)
    if run["--forecast"]:
        return  # the table of a forecast: test_step_peak.py (the forecast takes seconds a run)
    code, table, err = run_cli([arg for arg in argv if arg != "--json"], capsys)  # the same, as a table
    assert code == 0 and "Traceback" not in err, err
    assert all(row["mode"].split(" ")[0] in table for row in result["modes"]), table
