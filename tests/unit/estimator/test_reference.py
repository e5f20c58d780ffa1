"""`estimator.reference` (`--beta`): the reference model's line and counts are what a live run binding
TRL's reference model computes (the same meta model sharded here with `fully_shard` as TRL's
prepare_fsdp calls it, read by the runtime's adapter), LoRA has no second model, FSDP1 and
transformers-sharded launches say they are not estimated, a negative beta is the CLI's error line,
and the reference's sharded params are in every step peak."""

import json

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accel_gradsync import GradSyncConfig
from accel_gradsync.estimator.cli import main
from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.fake_shard import fake_world
from accel_gradsync.estimator.inputs import RECIPE_DEFAULT, LoraSpec, load_model_config, read_accelerate_config
from accel_gradsync.estimator.meta_model import build_meta_model
from accel_gradsync.estimator.reference import PASS_UNMODELED, add_reference, estimate_reference
from accel_gradsync.estimator.results import ReferenceEstimate
from accel_gradsync.estimator.step_peak import StepPeak
from accel_gradsync.planning.residency import decide_residency
from accel_gradsync.runtime.core.decision import describe_frozen, frozen_keeps
from accel_gradsync.runtime.integration.bind import model_name
from accel_gradsync.runtime.wrappers.adapt import adapt_model

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning"),
]
M, BETA = 3, 0.04


@pytest.fixture(scope="module")
def bf16(fsdp):
    return fsdp(2, "bf16")


@pytest.fixture(scope="module")
def with_beta(bf16):
    return estimate(RECIPE_DEFAULT, bf16, M, beta=BETA)


def live_binding(
    mixed_precision: torch.dtype | None, processes: int = 2, config: GradSyncConfig | None = None
) -> tuple[str, int, bool, int]:
    """(decision line, units, keeps, sharded bytes on rank 0) of the recipe's model as a live run
    binds TRL's reference model: `fully_shard` at the root with the plugin's settings, as
    prepare_fsdp calls it, its params left requiring grad as TRL leaves them."""
    settings = (config or GradSyncConfig()).resolved()
    model = build_meta_model(load_model_config(RECIPE_DEFAULT))
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=mixed_precision)
    with fake_world(processes):
        fully_shard(model, reshard_after_forward=True, mp_policy=policy)
        adapter = adapt_model(model)
        assert adapter is not None
        residency = decide_residency(settings, sum(u.param_bytes for u in adapter.units), lambda: 0)
        keeps = residency.resident or frozen_keeps(adapter.units, settings.gather_for_generation)
        line = describe_frozen("ref_model", model_name(model), adapter, keeps, residency)
        sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return line, len(adapter.units), keeps, sharded


def test_the_reference_is_what_a_live_run_binds(with_beta):
    line, units, keeps, sharded = live_binding(torch.bfloat16)
    ref = with_beta.reference
    assert ref is not None and ref.estimated and not ref.policy_adapter_off
    assert (ref.line, ref.units, ref.keeps, ref.sharded_param_bytes) == (line, units, keeps, sharded)
    assert units == 1 and keeps  # TRL's one unit, kept across the log-prob pass
    # The plugin gathers its one unit once per step; stock FSDP2 once per micro-batch's log-prob forward.
    assert (ref.all_gathers_per_step, ref.stock_all_gathers_per_step) == (1, M)
    params = sum(u["numel"] for u in with_beta.units)  # the trained model's, the same architecture
    assert ref.unsharded_param_bytes == params * 2  # bf16 compute
    assert ref.send_bytes_per_step == params * 2 // 2  # ring: (N-1)/N of one gather over 2 ranks


def test_a_resident_reference_is_what_a_live_run_binds_and_is_planned_around(bf16):
    """Kept resident, it gathers once for the run (none per step), its unsharded params are in every
    phase of every row's step peak, and budget plans the trained units within the budget less them."""

    def budget_row(config: GradSyncConfig):
        est = estimate(RECIPE_DEFAULT, bf16, M, config=config, beta=BETA)
        return est, next(m for m in est.modes if m.mode.startswith("budget"))

    # A budget that holds exactly the whole plan when nothing is reserved.
    _, whole = budget_row(GradSyncConfig(memory_budget="1GiB", keep_reference_unsharded="false"))
    budget = f"{whole.held_bytes + whole.held_param_bytes}B"
    _, without = budget_row(GradSyncConfig(memory_budget=budget, keep_reference_unsharded="false"))
    assert without.units_held == whole.units_held > 0
    config = GradSyncConfig(memory_budget=budget, keep_reference_unsharded="true")
    est, row = budget_row(config)
    ref = est.reference
    line, units, keeps, sharded = live_binding(torch.bfloat16, config=config)
    assert ref is not None and (ref.line, ref.units, ref.keeps, ref.sharded_param_bytes) == (
        line,
        units,
        keeps,
        sharded,
    )
    params = sum(u["numel"] for u in est.units)  # the trained model's, the same architecture
    assert ref.resident and ref.reserved_bytes == ref.unsharded_param_bytes == params * 2  # bf16 compute
    assert (ref.all_gathers_per_step, ref.first_step_all_gathers, ref.stock_all_gathers_per_step) == (0, 1, M)
    assert "then none: kept unsharded for the whole run" in ref.line
    # The budget less the resident bytes no longer holds the whole plan.
    assert row.held_bytes + row.held_param_bytes <= whole.held_bytes + whole.held_param_bytes - ref.reserved_bytes
    assert row.units_held < whole.units_held or row.held_param_bytes < whole.held_param_bytes
    peak = StepPeak(1000, "later_micro_batch", {"sharded_params": 100, "optimizer_state": 200})
    resident = ReferenceEstimate(
        BETA, "", units=1, keeps=True, resident=True, sharded_param_bytes=50, unsharded_param_bytes=400
    )
    with_ref = add_reference(peak, resident)
    assert with_ref.parts["reference_params"] == 450
    assert (with_ref.peak_bytes, with_ref.phase) == (1450, "later_micro_batch")
    assert with_ref.parts["reference_pass"] == 100 + 200 + 450  # nothing more to gather for its pass


def test_each_row_decides_residency_for_its_own_mode(bf16):
    """keep_reference_unsharded=auto: the modes that plan memory keep the reference resident where
    it fits (a budget that holds the whole plan, and 64 GiB free, hold its bf16 params), the others
    gather it once per step, whatever mode is selected; the header is the selected mode's. The
    budget row plans within its budget less the resident bytes, as a launch with budget selected
    does, and holds less than the whole plan."""
    free = "64GiB"
    whole = next(
        m
        for m in estimate(RECIPE_DEFAULT, bf16, M, config=GradSyncConfig(memory_budget="1GiB")).modes
        if m.mode.startswith("budget")
    )
    budget = f"{whole.held_bytes + whole.held_param_bytes}B"
    config = GradSyncConfig(sync_mode="per_micro_batch", memory_budget=budget, free_memory=free)
    est = estimate(RECIPE_DEFAULT, bf16, M, config=config, beta=BETA)
    params = sum(u["numel"] for u in est.units)  # the trained model's, the same architecture
    rows = {m.mode.split(" ")[0]: m for m in est.modes}
    assert est.reference is not None and not est.reference.resident  # per_micro_batch selected
    for mode in ("per_micro_batch", "deferred", "deferred+windowed"):
        assert (rows[mode].reference_resident, rows[mode].reference_all_gathers) == (False, 1), mode
    for mode in ("budget", "auto"):
        assert (rows[mode].reference_resident, rows[mode].reference_all_gathers) == (True, 0), mode
    selected = estimate(
        RECIPE_DEFAULT, bf16, M, config=GradSyncConfig(sync_mode="budget", memory_budget=budget), beta=BETA
    )
    assert selected.reference is not None and selected.reference.reserved_bytes == params * 2  # bf16 compute
    budget_row = next(m for m in selected.modes if m.mode.startswith("budget"))
    assert (rows["budget"].units_held, rows["budget"].held_bytes, rows["budget"].held_param_bytes) == (
        budget_row.units_held,
        budget_row.held_bytes,
        budget_row.held_param_bytes,
    )
    assert rows["budget"].held_bytes + rows["budget"].held_param_bytes < whole.held_bytes + whole.held_param_bytes
    without = estimate(RECIPE_DEFAULT, bf16, M, config=config)
    assert all("reference_resident" not in row for row in without.to_dict()["modes"])


def test_the_table_and_json_carry_the_reference_only_with_beta(bf16, with_beta, good, capsys):
    main(["estimate", "--accelerate-config", good, "--micro-batches", str(M), "--beta", str(BETA), "--json"])
    assert json.loads(capsys.readouterr().out)["reference"]["all_gathers_per_step"] == 1
    main(["estimate", "--accelerate-config", good, "--micro-batches", str(M), "--beta", str(BETA)])
    assert capsys.readouterr().out.splitlines()[1].startswith("grad sync: reference model ref_model (")
    without = estimate(RECIPE_DEFAULT, bf16, M)
    assert without.reference is None and "reference" not in without.to_dict()
    assert with_beta.to_dict()["reference"]["line"] == with_beta.reference.line


@pytest.mark.parametrize("beta", ["-0.04", "nan"])
def test_a_negative_beta_is_the_clis_error_line(cli_error, good, capsys, beta):
    line = cli_error(capsys, "--accelerate-config", good, "--beta", beta)
    assert f"--beta={float(beta)}" in line and "0 (TRL's default: no reference model) or positive" in line, line


def test_lora_has_no_second_model(fsdp):
    setup = read_accelerate_config(fsdp(2))
    ref = estimate_reference(
        BETA, load_model_config(RECIPE_DEFAULT), torch.float32, setup, GradSyncConfig(), M, LoraSpec(8)
    )
    assert ref is not None and ref.policy_adapter_off and ref.units == ref.all_gathers_per_step == 0
    assert "policy with its adapter disabled" in ref.line


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param({"accelerate": 1}, id="fsdp1"),
        pytest.param({"distributed": {"fsdp_size": 2}}, id="transformers-sharded"),
    ],
)
def test_launches_the_plugin_does_not_bind_say_so(fsdp, launch):
    est = estimate(
        RECIPE_DEFAULT,
        fsdp(launch["accelerate"]) if "accelerate" in launch else None,
        M,
        distributed_config=launch.get("distributed"),
        beta=BETA,
    )
    assert est.reference is not None and not est.reference.estimated
    assert est.reference.line.startswith("grad sync: reference model: not estimated")


def test_one_process_sends_nothing(fsdp):
    setup = read_accelerate_config(fsdp(2, processes=1))
    ref = estimate_reference(BETA, load_model_config(RECIPE_DEFAULT), torch.float32, setup, GradSyncConfig(), M)
    assert ref is not None and ref.units == 1
    assert ref.all_gathers_per_step == ref.stock_all_gathers_per_step == ref.send_bytes_per_step == 0


def test_the_reference_is_resident_in_every_phase_and_its_pass_is_a_phase():
    peak = StepPeak(1000, "later_micro_batch", {"sharded_params": 100, "optimizer_state": 200, "generation_peak": 900})
    ref = ReferenceEstimate(BETA, "", units=1, keeps=True, sharded_param_bytes=50, unsharded_param_bytes=100)
    with_ref = add_reference(peak, ref)
    assert (with_ref.peak_bytes, with_ref.phase) == (1050, "later_micro_batch")
    assert with_ref.parts["reference_params"] == 50 and with_ref.parts["generation_peak"] == 950
    assert with_ref.parts["reference_pass"] == 100 + 200 + 50 + 100
    assert with_ref.unmodeled == [PASS_UNMODELED]
    big = add_reference(peak, ReferenceEstimate(BETA, "", units=1, sharded_param_bytes=50, unsharded_param_bytes=2000))
    assert (big.peak_bytes, big.phase) == (100 + 200 + 50 + 2000, "reference_pass")
    lora = ReferenceEstimate(BETA, "", policy_adapter_off=True)
    assert add_reference(peak, lora) is peak and add_reference(peak, None) is peak
    # A window keeps the trained model's params unsharded from generation through the pass.
    windowed = add_reference(peak, ref, policy_kept=700)
    assert windowed.parts["reference_pass"] == 100 + 200 + 700 + 50 + 100 and windowed.phase == "reference_pass"


def test_every_rows_step_peak_holds_the_sharded_reference(good, capsys):
    args = ["estimate", "--accelerate-config", good, "--micro-batches", "1", "--micro-batch-size", "1"]
    main([*args, "--seq-len", "8", "--beta", str(BETA), "--json"])
    with_ref = json.loads(capsys.readouterr().out)
    main([*args, "--seq-len", "8", "--json"])
    without = {m["mode"]: m for m in json.loads(capsys.readouterr().out)["modes"]}
    sharded = with_ref["reference"]["sharded_param_bytes"]
    assert sharded > 0
    for row in with_ref["modes"]:
        if row["step_peak_bytes"] is None:
            continue
        assert row["step_peak_parts"]["reference_params"] == sharded
        # Every phase holds the sharded reference; its own pass is a phase that can be the peak
        # (the window row's on torch 2.15, whose windowed micro-batch the tracker sees smaller).
        expected = max(without[row["mode"]]["step_peak_bytes"] + sharded, row["step_peak_parts"]["reference_pass"])
        assert row["step_peak_bytes"] == expected, row["mode"]


def test_the_windowed_row_holds_the_trained_params_through_the_reference_pass(good, capsys):
    """The window keeps the trained model's units unsharded from generation's first forward to the
    window's end, so its reference pass holds them beside the reference model; deferral does not."""
    args = ["estimate", "--accelerate-config", good, "--micro-batches", "3", "--micro-batch-size", "1"]
    main([*args, "--seq-len", "8", "--beta", str(BETA), "--json"])
    rows = {m["mode"]: m for m in json.loads(capsys.readouterr().out)["modes"]}
    window, deferred = rows["deferred+windowed"], rows["deferred"]
    assert window["held_param_bytes"] > 0 and deferred["held_param_bytes"] == 0
    passes = [r["step_peak_parts"]["reference_pass"] for r in (window, deferred)]
    extra = window["step_peak_parts"]["optimizer_state"] - deferred["step_peak_parts"]["optimizer_state"]
    assert passes[0] - passes[1] == window["held_param_bytes"] + extra
