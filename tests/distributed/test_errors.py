"""`attach` refuses misuse before any training step, with a message that says what to change."""

import pytest
from launcher import accelerate_config, launch


def test_fsdp_config_without_cpu_enablement_is_refused():
    # Without enable_cpu_fsdp(), accelerate runs two lone processes on a CPU-only machine.
    (rank0, rank1) = launch("errors", ["--case", "no_enable"], accelerate_config("fsdp2"))
    for rank in (rank0, rank1):
        msg = rank["no_enable"]
        assert msg.startswith("ValueError")
        assert "ACCELERATE_USE_FSDP=true" in msg and "enable_cpu_fsdp()" in msg
        assert "use_configured_state" in msg


@pytest.fixture(scope="module")
def misuse():
    return launch("errors", ["--case", "misuse"], accelerate_config("fsdp2"))


@pytest.fixture(scope="module", params=["fsdp1", "fsdp2"])
def modes(request):
    return request.param, launch("errors", ["--case", "modes"], accelerate_config(request.param))


def test_unwrapped_model_under_fsdp_config_is_refused(misuse):
    for rank in misuse:
        assert rank["not_wrapped"].startswith("ValueError")
        assert "not FSDP-wrapped" in rank["not_wrapped"] and "TinyNet" in rank["not_wrapped"]


def test_a_model_with_no_wrapper_gets_one_warning_where_bind_was_called():
    # torchrun: accelerate's DDP. A model it never prepared has no gradient sync to schedule:
    # binding it warns once, at the caller's line, and accelerate's own no_sync applies.
    for rank in launch("errors", ["--case", "unwrapped"]):
        assert rank["bind"] == rank["bind_again"] == "None"
        (warning,) = rank["warnings"]
        assert warning["category"] == "GradSyncWarning"
        assert "(TinyNet) is not wrapped in FSDP or DDP" in warning["message"]
        assert "accelerate's own no_sync() applies" in warning["message"]
        assert warning["file"] == rank["worker_file"]
        assert rank["grad"]


def test_deferral_with_sync_each_batch_names_both_settings(misuse):
    for rank in misuse:
        msg = rank["sync_each_batch"]
        assert msg.startswith("ValueError") and "sync_each_batch=True" in msg and "defer=False" in msg


def test_attach_twice_and_wrong_target(misuse):
    for rank in misuse:
        assert rank["attach_twice"].startswith("ValueError") and ".detach()" in rank["attach_twice"]
        assert rank["not_a_target"].startswith("TypeError") and "Accelerator" in rank["not_a_target"]
        assert rank["class_after_detach"] == "Accelerator"


def test_modes_that_need_fsdp2_or_hsdp_say_so(modes):
    wrapper, ranks = modes
    for rank in ranks:
        if wrapper == "fsdp1":
            for mode in ("budget", "defer_all_reduce"):
                assert rank[mode].startswith("ValueError") and f"sync mode {mode!r} needs FSDP2" in rank[mode]
                assert "fsdp_version: 2" in rank[mode]
        else:
            assert rank["budget"] == "no error"  # FSDP2 supports budgets
            msg = rank["defer_all_reduce"]
            assert msg.startswith("ValueError") and "replicate dimension" in msg and "dp_replicate_size" in msg
