"""window_checks.py: what a window tells the user about how its `no_sync` was used, read from the
attachment's mode and M alone (the 2-rank runs: tests/distributed/test_sharded_by_transformers.py)."""

from types import SimpleNamespace

import pytest

from accel_gradsync.runtime.accumulation.window_checks import check_explicit_no_sync, warn_if_sync_each_batch


def attachment(mode: str, m: int = 1, sync_each_batch: bool = False) -> SimpleNamespace:
    warned: dict[str, str] = {}
    gradient_state = SimpleNamespace(plugin_kwargs={"sync_each_batch": sync_each_batch})
    return SimpleNamespace(
        policy=SimpleNamespace(name=mode),
        micro_batches_per_step=m,
        accelerator=SimpleNamespace(gradient_state=gradient_state),
        warned=warned,
        warn_once=lambda key, message: warned.setdefault(key, message),
    )


@pytest.mark.parametrize("mode", ["budget", "auto"])
def test_a_mode_that_plans_for_m_refuses_no_sync_when_m_is_unknown(mode):
    with pytest.raises(ValueError) as refused:
        check_explicit_no_sync(attachment(mode, m=1))
    message = str(refused.value)
    assert f"sync mode '{mode}'" in message and "gradient_accumulation_steps=1" in message
    assert "Accelerator(gradient_accumulation_steps=M)" in message and "'deferred'" in message
    check_explicit_no_sync(attachment(mode, m=4))  # M known: it plans for it


def test_per_micro_batch_says_once_that_it_overrides_no_sync():
    state = attachment("per_micro_batch")
    check_explicit_no_sync(state)
    assert "overridden by sync mode 'per_micro_batch'" in state.warned["explicit_no_sync"]
    assert "--defer-grad-sync" in state.warned["explicit_no_sync"]
    deferred = attachment("deferred")
    check_explicit_no_sync(deferred)
    assert deferred.warned == {}


def test_sync_each_batch_switched_on_is_said_only_where_the_mode_holds_something():
    for mode, warned in (("deferred", True), ("windowed", True), ("per_micro_batch", False)):
        state = attachment(mode, m=4, sync_each_batch=True)
        warn_if_sync_each_batch(state)
        assert ("sync_each_batch" in state.warned) is warned, mode
    quiet = attachment("deferred", m=4, sync_each_batch=False)
    warn_if_sync_each_batch(quiet)
    assert quiet.warned == {}
