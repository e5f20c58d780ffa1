"""The FSDP2 private attributes the adapter reads are checked at bind, with a message that names
the torch version: real `fully_shard` on a 1-rank gloo group (no mock), with one attribute hidden
the way a torch release that renamed it would."""

import re

import pytest
import torch

from accel_gradsync.runtime.fsdp2 import FSDP2Adapter
from accel_gradsync.runtime.fsdp2_state import check_fsdp2_internals


@pytest.mark.compat
def test_this_torch_has_what_the_adapter_reads(fsdp2_model):
    check_fsdp2_internals(fsdp2_model)
    assert len(FSDP2Adapter(fsdp2_model).units) == 2


def test_a_renamed_attribute_is_named_with_the_torch_version(fsdp2_model, monkeypatch):
    group = fsdp2_model._get_fsdp_state()._fsdp_param_groups[0]  # the first unit checked: the root
    monkeypatch.delattr(type(group), "post_forward_mesh_info", raising=False)
    monkeypatch.delattr(group, "post_forward_mesh_info", raising=False)
    with pytest.raises(
        RuntimeError,
        match=rf"post_forward_mesh_info.*torch {re.escape(torch.__version__)}.*tested: torch 2.13, 2.14 or 2.15",
    ):
        check_fsdp2_internals(fsdp2_model)
