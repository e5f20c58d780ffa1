"""What holding gradients in bf16 does to them, on real 2-rank gloo FSDP runs under bf16 mixed
precision: the gradients a holding mode steps with against per-micro-batch sync's from the same
weights and data (workers/bf16_precision.py). FSDP2 holds in the reduce dtype, so a bf16 reduce
sums the micro-batches in bf16 (they differ) and an fp32 one in fp32 (they are equal); FSDP1's
`no_sync()` holds the compute dtype whatever the reduce dtype. `auto` and `budget` hold fp32 by
default, and FSDP1's `auto` does not defer. `pytest -s -k table` prints the table docs/modes.md
shows."""

import json

import pytest
from launcher import accelerate_config, launch

M = 4
FP32 = {"reduce_dtype": "fp32"}
BF16 = {"reduce_dtype": "bf16"}
FSDP2_CASES = [
    {"name": "deferred", "config": {"defer": True}, "reference": {}},
    {"name": "deferred_bf16", "config": {"defer": True, **BF16}, "reference": BF16},
    {"name": "deferred_fp32", "config": {"defer": True, **FP32}, "reference": FP32},
    {"name": "auto", "config": {"sync_mode": "auto"}, "reference": FP32},
    {"name": "auto_bf16", "config": {"sync_mode": "auto", **BF16}, "reference": BF16},
    {"name": "budget", "config": {"memory_budget": "1GiB"}, "reference": FP32},
    {"name": "budget_after_prepare", "config": {"memory_budget": "1GiB"}, "reference": {}, "after_prepare": True},
]
FSDP1_CASES = [
    {"name": "deferred", "config": {"defer": True}, "reference": {}},
    {"name": "deferred_fp32", "config": {"defer": True, **FP32}, "reference": FP32},
    {"name": "auto", "config": {"sync_mode": "auto"}, "reference": FP32},
]
RUNS = {
    "fsdp2": ("fsdp2", {}, FSDP2_CASES),
    "fsdp1_orig_params": ("fsdp1", {"fsdp_use_orig_params": True}, FSDP1_CASES),
    "fsdp1_flat_params": ("fsdp1", {"fsdp_use_orig_params": False}, FSDP1_CASES),
}
MEASURED: dict[str, dict] = {}


@pytest.fixture(scope="module", params=[pytest.param(k, marks=() if k == "fsdp2" else pytest.mark.slow) for k in RUNS])
def run(request):
    kind, fsdp, cases = RUNS[request.param]
    config = {**accelerate_config(kind, **fsdp), "mixed_precision": "bf16"}
    ranks = launch("bf16_precision", ["--M", str(M), "--cases", json.dumps(cases)], config)
    assert ranks[0]["cases"].keys() == ranks[1]["cases"].keys()
    MEASURED[request.param] = ranks[0]["cases"]
    return request.param, ranks[0]["cases"]  # the relative difference is all-reduced: one per run


def _low_precision_warnings(case: dict) -> list[str]:
    return [w for w in case["warnings"] if "sums the held gradients" in w]


def test_bf16_sums_differ_from_per_micro_batch_and_fp32_sums_equal_them(run):
    name, cases = run
    for case in ("deferred", "deferred_bf16", "auto_bf16", "budget_after_prepare"):
        if case in cases:
            assert cases[case]["held_dtypes"] == ["bfloat16"], (case, cases[case])
            assert cases[case]["relative_difference"] > 1e-4, (case, cases[case])
    if name == "fsdp2":
        for case in ("deferred_fp32", "auto", "budget"):
            assert cases[case]["held_dtypes"] == ["float32"], (case, cases[case])
            assert cases[case]["relative_difference"] == 0.0, (case, cases[case])
    else:  # FSDP1's no_sync() holds bf16 whatever the reduce dtype
        assert cases["deferred_fp32"]["held_dtypes"] == ["bfloat16"]
        assert cases["deferred_fp32"]["relative_difference"] > 1e-4


def test_auto_and_budget_hold_fp32_by_default_and_count_its_bytes(run):
    name, cases = run
    auto = cases["auto"]
    if name == "fsdp2":
        for case in ("auto", "budget"):
            assert cases[case]["peak_held_grad_bytes"] == cases[case]["held_grad_bytes"] == 4 * cases[case]["params"]
            assert "summed in float32 (the reduce dtype, over bfloat16 compute)" in cases[case]["decision"]
        assert cases["auto_bf16"]["peak_held_grad_bytes"] == 2 * auto["params"]  # the setting that keeps bf16
    else:  # deferring would sum in bf16: auto syncs every micro-batch, as exact as per_micro_batch
        assert auto["held_dtypes"] == [] and auto["peak_held_grad_bytes"] == 0
        assert auto["relative_difference"] == 0.0
        assert "deferring would sum gradients in bfloat16" in auto["decision"], auto["decision"]
    for case in ("auto", "budget"):
        if case in cases:
            assert not _low_precision_warnings(cases[case]), cases[case]["warnings"]
            assert not [w for w in cases[case]["warnings"] if "wider" in w], cases[case]["warnings"]


def _set_lines(case: dict) -> list[str]:
    return [line for line in case["attach_printed"] if line.startswith("grad sync: reduce_dtype set")]


def test_attach_says_it_set_fp32_and_why(run):
    name, cases = run
    for case in ("auto", "budget"):
        if case in cases:
            (line,) = _set_lines(cases[case])
            assert line.startswith(f"grad sync: reduce_dtype set to fp32 for sync mode {case} (bf16 compute): "), line
            assert ("summed in fp32 as per-micro-batch sync sums them" if name == "fsdp2" else "does not defer") in line
            assert "reduce_dtype=bf16" in line, line
    for chosen in ("deferred", "deferred_fp32", "auto_bf16", "budget_after_prepare"):
        if chosen in cases:  # accelerate's dtype, the user's own, or too late to change: nothing set
            assert _set_lines(cases[chosen]) == [], cases[chosen]["attach_printed"]


def test_the_decision_line_names_the_dtype_held_gradients_are_summed_in(run):
    name, cases = run
    line = cases["deferred"]["decision"]
    assert "summed in bfloat16" in line and "the gradients differ" in line, line
    assert ("reduce_dtype=fp32" if name == "fsdp2" else "per_micro_batch") in line, line
    if name == "fsdp2":
        assert "summed in float32" in cases["deferred_fp32"]["decision"]


def test_bf16_deferral_warns_once_with_the_fix(run):
    name, cases = run
    (warning,) = _low_precision_warnings(cases["deferred"])
    assert f"of {M} micro-batches in bfloat16" in warning, warning
    if name == "fsdp2":
        assert "--grad-sync-reduce-dtype fp32" in warning and "ACCEL_GRADSYNC_REDUCE_DTYPE=fp32" in warning
        (late,) = _low_precision_warnings(cases["budget_after_prepare"])
        assert "before accelerator.prepare()" in late, late
        for chosen in ("deferred_bf16", "auto_bf16", "deferred_fp32"):  # bf16 chosen knowingly, or fp32
            assert not _low_precision_warnings(cases[chosen]), cases[chosen]["warnings"]
    else:
        assert "FSDP2 (fsdp_version: 2)" in warning and "per_micro_batch" in warning, warning
        (fp32,) = _low_precision_warnings(cases["deferred_fp32"])  # an fp32 reduce does not help FSDP1


def test_table(run):
    """The relative differences docs/modes.md shows (`pytest -s`), once every run is measured."""
    if len(MEASURED) < len(RUNS):
        return
    print("\n| wrapper | sync mode | reduce dtype | held in | relative difference to per_micro_batch |")
    print("|---|---|---|---|---|")
    for wrapper, cases in MEASURED.items():
        for name, case in cases.items():
            config = next(c for c in RUNS[wrapper][2] if c["name"] == name)
            mode = name.split("_")[0] + (" (attached after prepare)" if config.get("after_prepare") else "")
            dtype = config["config"].get("reduce_dtype", "auto (default)")
            held = ", ".join(case["held_dtypes"]) or "nothing (per micro-batch)"
            print(f"| {wrapper} | {mode} | {dtype} | {held} | {case['relative_difference']:.2%} |")
