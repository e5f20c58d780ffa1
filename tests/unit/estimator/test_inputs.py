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
    with pytest.raises(ValueError, match="no such directory"):
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


# --model: a path that is not there, a config transformers cannot read, a hub name offline. Each is
# one line naming --model, the value and what to pass instead; never the hub client's "Repo id must
# be in the form ..." for a path, never transformers' multi-line text.


@pytest.mark.parametrize(
    "spec", ["{tmp}/no/such/path", "./no-such-dir-here", "no/such/dir/at/all", "~/no-such-dir-here"]
)
def test_a_model_path_that_is_not_there_says_no_such_directory(cli_error, good, tmp_path, capsys, spec):
    spec = spec.format(tmp=tmp_path)
    line = cli_error(capsys, "--accelerate-config", good, "--model", spec)
    assert f"--model {spec!r}: no such directory" in line and "config.json" in line, line
    assert "Repo id" not in line and "repo_type" not in line, line


def test_a_config_file_that_is_not_there_says_no_such_file(cli_error, good, tmp_path, capsys):
    spec = str(tmp_path / "config.json")
    line = cli_error(capsys, "--accelerate-config", good, "--model", spec)
    assert f"--model {spec!r}: no such file" in line, line


def test_an_empty_model_is_refused_not_read_as_the_working_directory(cli_error, good, capsys):
    line = cli_error(capsys, "--accelerate-config", good, "--model", "")
    assert "--model ''" in line and "recipe-default" in line and "no config.json" not in line, line


def _model_dir(tmp_path, text: str):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    return str(model)


def test_an_unknown_model_type_names_it_in_one_line(cli_error, good, tmp_path, capsys):
    from transformers import __version__

    model = _model_dir(tmp_path, '{"model_type": "nosuchmodel", "hidden_size": 8}')
    line = cli_error(capsys, "--accelerate-config", good, "--model", model)
    assert f"--model {model!r}" in line and "model_type='nosuchmodel'" in line, line
    assert f"transformers {__version__}" in line and "pip install" not in line, line


def test_an_unknown_model_type_in_a_config_dict_names_it_without_the_list_of_known_ones(fsdp):
    with pytest.raises(ValueError, match=r"model_type='nosuchmodel'") as info:
        estimate({"model_type": "nosuchmodel"}, fsdp(2), 4)
    assert "\n" not in str(info.value) and "albert" not in str(info.value), info.value


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"model_type": "qwen2",', "not valid JSON"),
        ('["qwen2"]', "not a JSON object"),
        ('{"hidden_size": 8}', "no model_type"),
        ('{"model_type": "qwen2", "hidden_size": "big"}', "hidden_size"),  # was a traceback
    ],
)
def test_a_config_json_transformers_cannot_read_is_one_line(cli_error, good, tmp_path, capsys, text, says):
    model = _model_dir(tmp_path, text)
    line = cli_error(capsys, "--accelerate-config", good, "--model", model)
    assert f"--model {model!r}" in line and says in line and "albert" not in line, line


def test_a_config_json_file_is_read_as_its_directory_is(good, tmp_path, capsys, qwen2_7b):
    import json

    from accel_gradsync.estimator.cli import main

    model = _model_dir(tmp_path, json.dumps(qwen2_7b))
    assert main(["estimate", "--accelerate-config", good, "--micro-batches", "2", "--model", model, "--json"]) == 0
    as_dir = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "estimate",
                "--accelerate-config",
                good,
                "--micro-batches",
                "2",
                "--model",
                f"{model}/config.json",
                "--json",
            ]
        )
        == 0
    )
    as_file = json.loads(capsys.readouterr().out)
    assert as_file["params"] == as_dir["params"] == 7_615_616_512  # Qwen2-7B's parameter count


def test_a_hub_name_offline_says_the_hub_is_off_in_one_line(good):
    import os
    import subprocess
    import sys

    # A process of its own: the hub client reads HF_HUB_OFFLINE when it is imported.
    cmd = [sys.executable, "-m", "accel_gradsync", "estimate", "--accelerate-config", good, "--micro-batches", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([*cmd, "--model", "no-such-org/no-such-model"], capture_output=True, text=True, env=env)
    lines = out.stderr.rstrip("\n").splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert "--model 'no-such-org/no-such-model'" in lines[1] and "HF_HUB_OFFLINE" in lines[1], lines
    assert "recipe-default" in lines[1], lines  # what runs offline


# The accelerate config's numbers: each read as an integer in its range, or refused naming the key.


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_processes": "two"}, "num_processes='two'"),
        ({"num_processes": 10**20}, f"num_processes={10**20}"),
        ({"fsdp_config": {"fsdp_version": 3}}, "fsdp_version=3"),
        ({"fsdp_config": {"fsdp_version": 2, "fsdp_min_num_params": "lots"}}, "fsdp_min_num_params='lots'"),
        ({"parallelism_config": {"parallelism_config_dp_replicate_size": 0}}, "dp_replicate_size=0"),
        (
            {
                "parallelism_config": {
                    "parallelism_config_dp_replicate_size": -1,
                    "parallelism_config_dp_shard_size": -2,
                }
            },
            "dp_replicate_size=-1",
        ),
    ],
)
def test_a_bad_number_in_the_accelerate_config_names_the_key_and_value(cli_error, tmp_path, capsys, change, named):
    import yaml

    keys = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}, **change}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(keys))
    line = cli_error(capsys, "--accelerate-config", str(path))
    assert str(path) in line and named in line, line


@pytest.mark.parametrize(
    ("keys", "named"),
    [('{"fsdp_size": "two"}', "fsdp_size='two'"), (f'{{"fsdp_size": {10**20}}}', f"fsdp_size={10**20}")],
)
def test_a_bad_number_in_the_distributed_config_names_the_key_and_value(cli_error, capsys, keys, named):
    line = cli_error(capsys, "--distributed-config", keys)
    assert "--distributed-config" in line and named in line, line
