"""Every accelerate_configs/*.yaml loads with accelerate's own loader and launch validation, and
has the keys that matter: real FSDP of the version its name says, the embedded model's decoder
layer as the wrap unit, 2 processes on one node (CPU-runnable), the HSDP mesh matching the
processes, and its launch line in a header comment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
EXPECTED = {"fsdp2", "fsdp1", "fsdp2_npu", "fsdp1_npu", "hsdp"}


def test_the_documented_configs_exist():
    assert {p.stem for p in CONFIGS} == EXPECTED


def launch_args(path: Path):
    args = launch_command_parser().parse_args(["--config_file", str(path), "recipes/grpo.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_asks_for_real_fsdp(path):
    config = load_config_from_file(str(path))
    assert config.distributed_type == DistributedType.FSDP
    version = 2 if path.stem in ("fsdp2", "fsdp2_npu", "hsdp") else 1
    assert int(config.fsdp_config["fsdp_version"]) == version
    assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    sys.path.insert(0, str(REPO / "recipes"))
    import embedded

    layer = embedded.build_model(embedded.build_tokenizer())._no_split_modules
    assert {config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]} == set(layer)

    args = launch_args(path)  # what `accelerate launch --config_file` makes of it
    assert args.use_fsdp and int(args.fsdp_version) == version
    header = path.read_text().split("\ndistributed_type:")[0]
    assert f"accelerate launch --config_file accelerate_configs/{path.name} " in header and "recipes/grpo.py" in header
    if path.stem == "hsdp":
        assert args.num_machines == 2 and args.use_parallelism_config
        assert args.parallelism_config_dp_replicate_size == args.num_machines
        assert args.parallelism_config_dp_replicate_size * args.parallelism_config_dp_shard_size == args.num_processes
    else:
        assert args.num_processes == 2 and args.num_machines == 1  # small enough for a 2-core CPU machine
        assert "GPU count" in header or "ASCEND_RT_VISIBLE_DEVICES" in header  # what to set on a real node


@pytest.mark.parametrize("path", [p for p in CONFIGS if "npu" in p.stem], ids=lambda p: p.stem)
def test_npu_configs_leave_the_backend_to_accelerate(path):
    text = path.read_text()
    assert "ASCEND_RT_VISIBLE_DEVICES" in text and "HCCL" in text
    assert "backend" not in load_config_from_file(str(path)).to_dict()  # accelerate picks hccl itself
