"""`estimator.inputs`: the accelerate config, `--distributed-config` and the model config, read and
checked; every bad input ends in one line naming the input and what is wrong, exit code 2 and no
traceback."""

import pytest

from accel_gradsync.estimator.core import estimate
from accel_gradsync.estimator.inputs import read_accelerate_config

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.filterwarnings("ignore::accel_gradsync.config.errors.GradSyncWarning"),
]


def test_malformed_yaml_names_the_file_and_where(cli_error, tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: [unclosed\n")
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "not valid YAML" in line and "line 3" in line, line


def test_yaml_that_is_not_a_mapping_names_the_file(cli_error, tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- distributed_type\n- FSDP\n")
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "mapping" in line, line


def test_a_directory_is_not_reported_as_missing(cli_error, tmp_path, capsys):
    line = cli_error(capsys, "--accelerate-config", str(tmp_path))
    assert str(tmp_path) in line and "is a directory" in line and "does not exist" not in line, line


@pytest.mark.parametrize("processes", ["0", "-2"])
def test_num_processes_below_one_is_refused(cli_error, good, capsys, processes):
    line = cli_error(capsys, "--accelerate-config", good, "--num_processes", processes)
    assert f"--num_processes={processes}" in line and "at least 1" in line, line


def test_num_processes_below_one_in_the_file_is_refused(good_text, cli_error, tmp_path, capsys):
    path = tmp_path / "zero.yaml"
    path.write_text(good_text.replace("num_processes: 2", "num_processes: 0"))
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and "num_processes=0" in line and "at least 1" in line, line


def test_a_model_directory_without_config_json(cli_error, good, tmp_path, capsys):
    model = tmp_path / "my-model"
    model.mkdir()
    line = cli_error(capsys, "--accelerate-config", good, "--model", str(model))
    assert str(model) in line and "no config.json" in line and "model_type" not in line, line


def test_recipe_default_is_the_recipes_model(fsdp):
    pytest.importorskip("datasets", reason="the recipe's model needs the `recipes` extra")
    from recipes.embedded import build_model, build_tokenizer

    real = build_model(build_tokenizer())
    est = estimate("recipe-default", fsdp(2), 4)
    assert est.params == sum(p.numel() for p in real.parameters())  # tied embedding counted once
    # accelerate's tied tail group [model.norm, model.embed_tokens, lm_head] is one unit, named as a
    # run names it (by its first module) and holding the shared embedding once, with the norm.
    embedding, norm = real.model.embed_tokens.weight.numel(), real.model.norm.weight.numel()
    assert est.units[0] == {"name": "model.embed_tokens", "numel": embedding + norm}


def test_bad_settings_name_the_setting_value_and_fix(fsdp, tmp_path):
    with pytest.raises(ValueError, match="distributed_type"):
        estimate("recipe-default", {"distributed_type": "MULTI_GPU", "num_processes": 2}, 4)
    with pytest.raises(ValueError, match="fsdp_transformer_layer_cls_to_wrap=LlamaDecoderLayer"):
        estimate("recipe-default", fsdp(2, fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer"), 4)
    # accelerate's own preparation fails here, as a launch would: the size policy picks the ModuleList.
    with pytest.raises(ValueError, match=r"accelerate cannot shard .*SIZE_BASED_WRAP.*does not support containers"):
        estimate("recipe-default", fsdp(2, fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=40000), 4)
    with pytest.raises(ValueError, match="micro_batches=0"):
        estimate("recipe-default", fsdp(2), 0)
    with pytest.raises(ValueError, match="no transformers config found"):
        estimate(str(tmp_path / "missing"), fsdp(2), 4)
    with pytest.raises(ValueError, match=r"2 x 3 != num_processes=4"):
        read_accelerate_config(
            {
                **fsdp(2, processes=4),
                "parallelism_config": {
                    "parallelism_config_dp_replicate_size": 2,
                    "parallelism_config_dp_shard_size": 3,
                },
            }
        )
