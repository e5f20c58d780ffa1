"""The GRPO benchmark's plan: which launches run in which order, and what each configuration asks
of the plugin."""

from benchmarks import grpo, run


def plan(*flags):
    return grpo.plan_of(run.parse_args(["--grpo", "--beta", "0.04", *flags]))


def test_fsdp2_and_ddp_launches_alternate_round_by_round():
    p = plan("--reps", "3")
    fsdp = [c for c in grpo.CONFIGS if not grpo.is_ddp(c)]
    ddp = ["full/ddp", "lora/ddp"]
    assert grpo.launches(p) == [(0, fsdp), (0, ddp), (1, fsdp), (1, ddp), (2, fsdp), (2, ddp)]
    # Each launch runs its own round; only FSDP2's time the backend's collectives.
    args = grpo.worker_args(p, "/m", False, ddp, 2)
    assert args[args.index("--round") + 1] == "2" and "--time-collectives" not in args
    assert "--time-collectives" in grpo.worker_args(p, "/m", False, fsdp, 0)
    only_fsdp = plan("--configs", "full/stock,full/windowed")
    assert grpo.launches(only_fsdp) == [(r, ["full/stock", "full/windowed"]) for r in range(only_fsdp["rounds"])]


def test_the_full_run_has_rounds_enough_for_a_spread_in_as_many_steps_as_before():
    full = grpo.SIZES["full"]
    assert (plan()["rounds"], plan()["steps"]) == (full["rounds"], full["steps"])
    assert full["rounds"] >= 3  # a median round and a spread around it
    # At most 6 optimizer steps per configuration: the full run's time (stock's slow steps dominate it).
    assert full["rounds"] * full["steps"] <= 2 * 3 and full["steps"] >= 2  # step 1 untimed


def test_windowed_keeps_a_reference_model_of_its_own_only_under_full_fine_tuning():
    assert grpo.CONFIGS["full/windowed"]["gradsync"] == {
        "defer": True,
        "keep_params_unsharded": True,
        "keep_reference_unsharded": True,
    }
    # LoRA: the reference is the policy with its adapter off, which windowed keeps anyway.
    assert "keep_reference_unsharded" not in grpo.CONFIGS["lora/windowed"]["gradsync"]
    assert [c for c in grpo.CONFIGS if grpo.keeps_reference(c)] == ["full/windowed"]
    assert grpo.CONFIGS["full/stock"]["gradsync"] is None
