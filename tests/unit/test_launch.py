"""`check_launch` in a single process, from the environment `accelerate launch` exports: a sync mode
the launch's wrapper cannot run and a restart the launcher cannot carry out are refused before any
model exists, naming the setting, the value and what to change."""

from __future__ import annotations

import os

import pytest

import accel_gradsync
from accel_gradsync import GradSyncConfig, check_launch
from accel_gradsync.launch import LaunchSetup, launch_setup

# What `accelerate launch` and torch elastic export that the check reads.
LAUNCH_VARIABLES = (
    "ACCELERATE_USE_FSDP",
    "FSDP_VERSION",
    "ACCELERATE_USE_PARALLELISM_CONFIG",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "WORLD_SIZE",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    """No launch and no accel_gradsync settings but those a test sets."""
    for name in [*LAUNCH_VARIABLES, *(n for n in os.environ if n.startswith("ACCEL_GRADSYNC_"))]:
        monkeypatch.delenv(name, raising=False)


def launched(monkeypatch, **env: str) -> None:
    """The environment of one rank of a 2-process FSDP launch, with `env` on top."""
    for name, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)


HSDP = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}


@pytest.mark.parametrize(
    ("env", "mode", "error"),
    [
        (
            {"FSDP_VERSION": "1"},
            "budget",
            r"^--grad-sync-mode budget \(or --grad-sync-memory-budget 1GiB, which selects it\): sync mode "
            r"'budget' needs FSDP2 .*, but the model is wrapped in fsdp1\. Use fsdp_version: 2",
        ),
        (
            {"FSDP_VERSION": "1"},
            "defer_all_reduce",
            r"^--grad-sync-mode defer_all_reduce: sync mode 'defer_all_reduce' needs FSDP2 .*, but the model is "
            r"wrapped in fsdp1",
        ),
        ({"FSDP_VERSION": "2"}, "defer_all_reduce", r"needs an HSDP mesh.*sharded over a 1-D mesh.*dp_replicate_size"),
        ({"FSDP_VERSION": "2", **HSDP}, "defer_all_reduce", None),
        ({"FSDP_VERSION": "2"}, "budget", None),
        ({"FSDP_VERSION": "1"}, "deferred", None),
        ({"ACCELERATE_USE_FSDP": "false"}, "budget", r"needs FSDP2 .*, but the model is wrapped in ddp"),
    ],
)
def test_sync_modes_the_launch_cannot_run_are_refused(monkeypatch, env, mode, error):
    launched(monkeypatch, **env)
    config = GradSyncConfig(sync_mode=mode, memory_budget="1GiB" if mode == "budget" else None)
    if error is None:
        check_launch(config)
    else:
        with pytest.raises(ValueError, match=error):
            check_launch(config)


def test_a_memory_budget_alone_is_named_as_what_selects_budget_mode(monkeypatch):
    launched(monkeypatch, FSDP_VERSION="1")
    with pytest.raises(ValueError, match=r"^--grad-sync-mode budget \(or --grad-sync-memory-budget 512MiB, which"):
        check_launch(GradSyncConfig(memory_budget="512MiB"))


def test_keep_params_unsharded_on_fsdp1_is_not_refused(monkeypatch):
    launched(monkeypatch, FSDP_VERSION="1")
    check_launch(GradSyncConfig(defer=True, keep_params_unsharded=True))  # attach warns that it does not apply


def test_the_default_config_is_the_environments(monkeypatch):
    launched(monkeypatch, FSDP_VERSION="2")
    check_launch()  # per_micro_batch runs anywhere
    monkeypatch.setenv("ACCEL_GRADSYNC_SYNC_MODE", "defer_all_reduce")
    with pytest.raises(ValueError, match=r"^--grad-sync-mode defer_all_reduce: .*needs an HSDP mesh"):
        check_launch()
    launched(monkeypatch, **HSDP)
    check_launch()


@pytest.mark.parametrize("world_size", [None, "1"])
def test_one_process_is_never_refused(monkeypatch, world_size):
    """One process has no sync to schedule: attach warns and does nothing, whatever the mode."""
    launched(monkeypatch, FSDP_VERSION="1")
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE")
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    check_launch(GradSyncConfig(sync_mode="defer_all_reduce"))
    check_launch(GradSyncConfig(memory_budget="1GiB"))


def test_restart_with_the_launchers_shared_store_is_refused(monkeypatch):
    launched(monkeypatch, FSDP_VERSION="2", TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_USE_AGENT_STORE="True")
    with pytest.raises(
        ValueError, match=r"^accelerate launch --max_restarts 1: .*--rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV"
    ):
        check_launch(GradSyncConfig())
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    check_launch(GradSyncConfig())
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # no restart: the shared store is fine
    check_launch(GradSyncConfig())


def test_launch_setup_reads_what_accelerate_exported(monkeypatch):
    assert launch_setup() == LaunchSetup(fsdp_version=0, replicate=1, processes=1)  # plain `python script.py`
    launched(monkeypatch, FSDP_VERSION="2", WORLD_SIZE="4", **HSDP)
    assert launch_setup() == LaunchSetup(fsdp_version=2, replicate=2, processes=4)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")  # the replicate size is read only with it
    monkeypatch.delenv("FSDP_VERSION")  # accelerate's default FSDP version
    assert launch_setup() == LaunchSetup(fsdp_version=1, replicate=1, processes=4)


def test_check_launch_is_public():
    assert "check_launch" in accel_gradsync.__all__ and accel_gradsync.check_launch is check_launch
