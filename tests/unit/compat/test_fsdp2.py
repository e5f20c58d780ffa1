"""Where each torch series keeps FSDP2's private state: the table is what bind checks and what
the adapter reads, on a real `fully_shard` model on a 1-rank gloo group (no mock); a series with
no entry is read and checked with the newest one."""

import pytest

from accel_gradsync.compat import fsdp2 as internals
from accel_gradsync.runtime.wrappers.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.wrappers.fsdp2_state import check_fsdp2_internals


@pytest.mark.parametrize(
    ("version", "series"),
    [("2.14.0+cu130", "2.14"), ("2.13.0", "2.13"), ("2.15.0", "2.15"), ("2.16.0", "2.15"), ("nightly", "2.15")],
)
def test_a_series_reads_its_own_entry_or_the_newest(version, series):
    assert internals.torch_series("2.14.1+cpu") == "2.14"
    assert internals.layout(version) is internals.FSDP2_PRIVATE[series]
    assert internals.release(version) is internals.FSDP2_RELEASES[series]


def test_every_series_has_a_table_and_a_release_and_says_why_each_name_is_private():
    assert internals.tabled_series() == ["2.13", "2.14", "2.15"]
    assert set(internals.FSDP2_RELEASES) == set(internals.FSDP2_PRIVATE) == set(internals.PRIVATE_CEILING)
    for table in internals.FSDP2_PRIVATE.values():
        assert set(table) <= set(internals.WHY_PRIVATE)


def test_private_reads_per_release_only_go_down(capsys):
    """The count of FSDP2 private attributes each series reads, printed (`pytest -s` shows it), and
    held to `PRIVATE_CEILING`: a change may lower a ceiling, never raise one. 2.15 reads two fewer
    than 2.14: it holds gradients on the unsharded parameter's `.grad` and needs no zero ones."""
    counts = {series: len(table) for series, table in internals.FSDP2_PRIVATE.items()}
    with capsys.disabled():
        print("\nFSDP2 private attributes read per torch series (plus FSDPModule._get_fsdp_state()):", counts)
    assert all(counts[s] <= internals.PRIVATE_CEILING[s] for s in counts), (counts, internals.PRIVATE_CEILING)
    assert counts["2.15"] < counts["2.14"]
    assert set(internals.FSDP2_PRIVATE["2.14"]) - set(internals.FSDP2_PRIVATE["2.15"]) == {
        "unsharded_accumulated_grad",
        "orig_size",
    }


@pytest.mark.compat
def test_this_torch_keeps_everything_where_its_entry_says(fsdp2_model):
    state = fsdp2_model._get_fsdp_state()
    (group,) = internals.read(state, "param_groups")
    assert internals.missing({internals.STATE: state, internals.GROUP: group}) is None
    assert internals.missing({internals.PARAM: internals.read(group, "fsdp_params")[0]}) is None


def test_an_attribute_a_release_moved_is_read_where_the_table_says(fsdp2_model, monkeypatch):
    """A release that renames an attribute is one table entry: bind checks the new name, and the
    adapter reads it there."""
    state = fsdp2_model._get_fsdp_state()
    (group,) = internals.read(state, "param_groups")
    table = internals.layout()
    monkeypatch.setitem(table, "reshard_after_backward", (internals.GROUP, "_reshard_after_backward_v2"))
    with pytest.raises(RuntimeError, match=r"FSDPParamGroup\._reshard_after_backward_v2, which torch"):
        check_fsdp2_internals(fsdp2_model)
    for unit in fsdp2_model.modules():  # the adapter reads it on every unit (a resident frozen one)
        if hasattr(unit, "_get_fsdp_state"):
            for each in internals.read(unit._get_fsdp_state(), "param_groups"):
                monkeypatch.setattr(each, "_reshard_after_backward_v2", True, raising=False)
    check_fsdp2_internals(fsdp2_model)
    assert len(FSDP2Adapter(fsdp2_model).units) == 2
