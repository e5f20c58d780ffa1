"""`estimator.core` without processes: the held dtype for every case of BACKGROUND.md, counts
consistent with the runtime's decision line, the n/a rows, the fit column, closed-form counts, one
process, and a 7B-class config estimated on the meta device in seconds.
(Against real 2-rank runs: tests/distributed/test_estimate_vs_measured.py.)"""

import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from accel_gradsync import GradSyncConfig
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.core import WINDOWED_ROW, estimate
from accel_gradsync.estimator.inputs import load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
from accel_gradsync.planning.policies import POLICIES
from accel_gradsync.runtime.core.decision import describe_decision

pytestmark = pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning")

QWEN2_7B_PARAMS = 7_615_616_512
ACCELERATE_CONFIGS = Path(__file__).resolve().parents[3] / "accelerate_configs"


@pytest.fixture(scope="module")
def seven_b(fsdp, qwen2_7b):
    """The 7B-class estimate, once: FSDP2, bf16, fp32 reduce, 2 replicas x 8 shards, M=8, 30 GiB free."""
    began = time.perf_counter()
    est = estimate(
        qwen2_7b,
        fsdp(2, "bf16", processes=16, replicate=2),
        8,
        GradSyncConfig(reduce_dtype="fp32", free_memory="30GiB", memory_budget="10GiB", sync_mode="budget"),
    )
    return est, time.perf_counter() - began


def test_7b_class_config_is_estimated_in_seconds_on_the_meta_device(qwen2_7b, seven_b):
    est, seconds = seven_b
    assert seconds < 60  # seconds on an idle machine; generous for a loaded 2-core CI runner
    assert est.params == QWEN2_7B_PARAMS
    assert len(est.units) == 28 + 2  # decoder layers, the untied input embedding, [norm, lm_head]
    model = build_meta_model(load_model_config(qwen2_7b))
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())


def test_7b_deferral_holds_4_bytes_per_param_with_fp32_reduce_and_does_not_fit_30gib(seven_b):
    est, _ = seven_b
    deferred = est.mode("deferred")
    assert (deferred.held_bytes, deferred.held_dtype) == (QWEN2_7B_PARAMS * 4, "fp32")  # 28.4 GiB
    assert deferred.peak_bytes > deferred.held_bytes and deferred.fits is False  # 27 GiB usable
    budget = est.mode("budget")
    assert budget.selected and 0 < budget.held_bytes <= 10 * 2**30 and budget.fits
    per_mb = est.mode("per_micro_batch")
    assert per_mb.fits is True and per_mb.held_bytes == 0
    # HSDP: only the all-reduce is deferred, so the held partial sums are sharded over 8 ranks.
    dar = est.mode("defer_all_reduce")
    assert dar.held_bytes == pytest.approx(QWEN2_7B_PARAMS * 4 / 8, rel=1e-3)  # padding: dim 0 to 8 ranks
    assert (dar.reduce_scatters, dar.all_reduces) == (30 * 8, 30)
    auto = est.mode("auto -> defer_all_reduce")
    assert auto.held_bytes == dar.held_bytes


@pytest.mark.parametrize(
    "version, mixed_precision, reduce_dtype, model_dtype, expected",
    [
        # FSDP2: the reduce dtype when it differs from the param dtype, else the param dtype.
        (2, "no", "auto", torch.float32, "fp32"),
        (2, "bf16", "auto", torch.float32, "bf16"),  # accelerate: param = reduce = bf16
        (2, "bf16", "fp32", torch.float32, "fp32"),  # verl's policy: 4 bytes/param
        (2, "no", "bf16", torch.float32, "bf16"),
        (2, "no", "auto", torch.bfloat16, "bf16"),  # a bf16 model without mixed precision
        # FSDP1: always the compute dtype.
        (1, "no", "auto", torch.float32, "fp32"),
        (1, "bf16", "auto", torch.float32, "bf16"),
        (1, "bf16", "fp32", torch.float32, "bf16"),
        (1, "no", "bf16", torch.float32, "fp32"),
    ],
)
def test_held_dtype_follows_the_wrapper_and_mixed_precision(
    fsdp, version, mixed_precision, reduce_dtype, model_dtype, expected
):
    est = estimate(
        "recipe-default",
        fsdp(version, mixed_precision),
        4,
        GradSyncConfig(reduce_dtype=reduce_dtype),
        model_dtype=model_dtype,
    )
    deferred = est.mode("deferred")
    assert deferred.held_dtype == expected
    assert deferred.held_bytes == est.params * {"fp32": 4, "bf16": 2}[expected]


def test_counts_agree_with_the_runtime_decision_line(fsdp):
    """Same plans (the runtime's policies), same counts as `describe_decision` prints."""
    config = GradSyncConfig(free_memory="1GiB", memory_budget="64KiB")
    for accelerate_config in (fsdp(2), fsdp(1), fsdp(2, processes=4, replicate=2)):
        setup = read_accelerate_config(accelerate_config)
        adapter = estimated_adapter(build_meta_model(load_model_config("recipe-default")), setup, config)
        est = estimate("recipe-default", accelerate_config, 4, config)
        for name, policy in POLICIES.items():
            row = next(m for m in est.modes if m.mode.split(" ")[0] == name)
            if not row.applicable:
                continue
            line = describe_decision(policy(config.resolved()).plan(adapter, lambda: 2**30, 4), adapter, 4)
            numbers = [int(n) for n in re.findall(r"(\d+) (?:reduce-scatters|all-reduces)", line)]
            gathers = re.search(r"(\d+) all-gathers/step", line)
            assert gathers is None or int(gathers.group(1)) == row.all_gathers, line
            if "all-reduces" in line:  # defer_all_reduce: "<rs> reduce-scatters and <ar> all-reduces/step"
                assert numbers[:2] == [row.reduce_scatters, row.all_reduces], line
            else:
                assert numbers[0] == row.reduce_scatters, line


def test_modes_that_do_not_apply_are_rows_with_the_reason(fsdp):
    est = estimate("recipe-default", fsdp(1), 4)
    rows = {m.mode: m for m in est.modes}
    assert list(rows) == [*POLICIES, WINDOWED_ROW]  # one row per mode the project offers, and the window
    assert not rows[WINDOWED_ROW].applicable and "SHARD_GRAD_OP" in rows[WINDOWED_ROW].reason
    assert not rows["budget"].applicable and "--grad-sync-memory-budget" in rows["budget"].reason
    assert not rows["defer_all_reduce"].applicable and "needs FSDP2" in rows["defer_all_reduce"].reason
    assert not rows["auto"].applicable and "--grad-sync-free-memory" in rows["auto"].reason
    with_budget = estimate("recipe-default", fsdp(1), 4, GradSyncConfig(memory_budget="1GiB"))
    assert "needs FSDP2" in with_budget.mode("budget").reason
    hsdp_less = estimate("recipe-default", fsdp(2), 4)
    assert "HSDP" in hsdp_less.mode("defer_all_reduce").reason


def test_all_gathers_follow_resharding_and_kept_params(fsdp):
    m = 3
    fsdp2 = estimate("recipe-default", fsdp(2), m, GradSyncConfig(defer=True, keep_params_unsharded=True))
    # 2 layers reshard after forward (forward + backward all-gather); accelerate's tail group does not.
    assert fsdp2.mode("per_micro_batch").all_gathers == 3 * m + 2 * m
    assert fsdp2.mode("deferred").all_gathers == 3 * m + 2 * m  # deferral alone gathers as often
    window = fsdp2.mode(WINDOWED_ROW)
    assert window.selected and window.all_gathers == 3  # params unsharded for the window: one gather per unit
    assert window.held_param_bytes == window.held_bytes == fsdp2.params * 4  # fp32 params, fp32 grads
    fsdp2_no_reshard = estimate("recipe-default", fsdp(2, fsdp_reshard_after_forward=False), m)
    assert fsdp2_no_reshard.mode("per_micro_batch").all_gathers == 3 * m
    grad_op = estimate("recipe-default", fsdp(1, fsdp_sharding_strategy="SHARD_GRAD_OP"), m)
    assert grad_op.mode("deferred").all_gathers == 3  # no_sync keeps SHARD_GRAD_OP params unsharded
    assert grad_op.mode("per_micro_batch").all_gathers == 3 * m
    p = grad_op.params * 4
    assert grad_op.mode("per_micro_batch").all_gather_bytes == pytest.approx(m * p / 2, abs=8)


def test_fits_compares_the_peak_with_free_memory_less_the_margin(fsdp):
    est = estimate("recipe-default", fsdp(2), 4, GradSyncConfig(free_memory="200KiB", memory_margin=0.0))
    assert est.mode("deferred").peak_bytes > 200 * 1024 and est.mode("deferred").fits is False
    assert est.mode("per_micro_batch").fits is None or est.mode("per_micro_batch").peak_bytes > 0
    assert estimate("recipe-default", fsdp(2), 4).mode("deferred").fits is None  # no free memory given
    auto = next(m for m in est.modes if m.mode.startswith("auto"))
    # auto plans held bytes within free memory (peak adds the transients: docs/estimate.md)
    assert auto.applicable and 0 < auto.held_bytes + auto.held_param_bytes <= 200 * 1024


def test_a_row_names_the_windowed_units_its_plan_keeps(fsdp):
    """With room for everything, auto windows every unit: the row says so, not plain deferral."""
    est = estimate("recipe-default", fsdp(2), 4, GradSyncConfig(free_memory="1GiB"))
    auto = next(r for r in est.modes if r.mode.startswith("auto"))
    assert auto.mode == "auto -> deferred+windowed", auto.mode


def test_a_huge_number_of_micro_batches_answers_at_once():
    """The counts are closed forms: 10^11 micro-batches answer as fast as 4 (a step-by-step count
    would not finish; the subprocess's timeout catches that)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel_gradsync",
            "estimate",
            "--micro-batches",
            str(10**11),
            "--accelerate-config",
            str(ACCELERATE_CONFIGS / "fsdp2.yaml"),
            "--grad-sync-free-memory",
            "1GiB",
            "--grad-sync-memory-budget",
            "100KiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    rows = {m["mode"].split(" ")[0]: m for m in json.loads(out.stdout)["modes"]}
    m = 10**11
    assert rows["per_micro_batch"]["all_gathers"] == 3 * m + 2 * m  # 2 layers gather again in backward
    assert rows["per_micro_batch"]["reduce_scatters"] == 3 * m and rows["deferred"]["reduce_scatters"] == 3
    assert rows[WINDOWED_ROW]["all_gathers"] == 3


@pytest.mark.parametrize("version", [1, 2])
def test_one_process_has_nothing_to_sync_and_no_mode_saves_anything(fsdp, version, tmp_path, capsys):
    config = GradSyncConfig(defer=True, keep_params_unsharded=True, free_memory="1GiB", memory_budget="100KiB")
    est = estimate("recipe-default", fsdp(version, processes=1), 4, config)
    rows = [m for m in est.modes if m.applicable]
    assert len(rows) >= 3
    per_mb = est.mode("per_micro_batch")
    for row in rows:
        assert (row.units_held, row.held_bytes, row.held_param_bytes) == (0, 0, 0), row
        # FSDP sends nothing over one rank: FSDP2 skips its collectives (counted below).
        assert (row.reduce_scatters, row.all_reduces, row.all_gathers, row.send_bytes) == (0, 0, 0, 0), row
        assert row.peak_bytes == per_mb.peak_bytes and "one process" in row.reason, row
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(fsdp(version, processes=1)))
    assert main(["estimate", "--accelerate-config", str(path), "--micro-batches", "4", "--defer-grad-sync"]) == 0
    assert "1 process (nothing to sync between ranks" in capsys.readouterr().out


def test_fsdp2_over_one_rank_issues_no_collective():
    """What the one-process rows rest on, from a real one-rank gloo group: no collective at all."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from testbed.collectives import CollectiveCounter

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        counter = CollectiveCounter()
        model = AutoModelForCausalLM.from_config(load_model_config("recipe-default"))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        for k in range(4):
            model.set_requires_gradient_sync(k == 3)  # deferred: three held micro-batches, then the sync
            ids = torch.randint(0, 17, (1, 8))
            model(input_ids=ids, labels=ids).loss.backward()
        assert counter.take() == {}
    finally:
        dist.destroy_process_group()


def test_estimate_from_python_warns_of_no_setting_its_own_rows_change(fsdp):
    """The deferred rows turn keep_params_unsharded on and off whatever mode is selected: no
    "ignored in sync mode" warning reaches a caller of `estimate()` for that."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate("recipe-default", fsdp(2), 2)
    assert not [w for w in caught if issubclass(w.category, GradSyncWarning)], [str(w.message) for w in caught]
