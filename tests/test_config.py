"""`GradSyncConfig` holds every default once; each entry point agrees with it and validates."""

import dataclasses

import pytest
from transformers import HfArgumentParser
from trl import TrlParser

from accel_gradsync import DEFAULTS, ENV_PREFIX, GradSyncConfig

FIELDS = [f.name for f in dataclasses.fields(GradSyncConfig)]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in FIELDS:
        monkeypatch.delenv(ENV_PREFIX + name.upper(), raising=False)


def test_every_field_has_one_default_and_help():
    assert sorted(FIELDS) == sorted(DEFAULTS)
    assert "config" not in FIELDS  # TrlParser reserves --config for the recipe YAML
    for f in dataclasses.fields(GradSyncConfig):
        assert len(f.metadata.get("help", "")) > 40, f.name
        assert f"Default: {DEFAULTS[f.name]!r}" in f.metadata["help"], f.name
        assert ENV_PREFIX + f.name.upper() in f.metadata["help"], f.name


def test_default_is_per_micro_batch_sync():
    assert DEFAULTS["defer"] is False
    assert GradSyncConfig().mode == "per_micro_batch"


@pytest.mark.parametrize("parser_cls", [HfArgumentParser, TrlParser])
def test_parsers_agree_with_the_dataclass(parser_cls):
    parser = parser_cls(GradSyncConfig)
    (parsed,) = parser.parse_args_into_dataclasses([])
    assert parsed == GradSyncConfig()
    assert dataclasses.asdict(parsed) == DEFAULTS
    (on,) = parser.parse_args_into_dataclasses(["--defer-grad-sync"])
    assert on.defer is True and on.mode == "deferred"
    (off,) = parser.parse_args_into_dataclasses(["--defer-grad-sync", "false"])
    assert off.defer is False


def test_environment_sits_between_explicit_value_and_default(monkeypatch):
    monkeypatch.setenv("ACCEL_GRADSYNC_DEFER", "true")
    assert GradSyncConfig().defer is True
    assert GradSyncConfig(defer=False).defer is False  # explicit wins
    (parsed,) = HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses([])
    assert parsed.defer is True  # an absent flag leaves the environment in charge


def test_memory_sizes_accept_units_and_budgets_accept_fractions():
    assert GradSyncConfig(sync_mode="budget", memory_budget="0.25").memory_budget == "0.25"
    assert GradSyncConfig(sync_mode="budget", memory_budget="512MiB").memory_budget == "512MiB"
    assert GradSyncConfig(sync_mode="auto", free_memory="40GiB").free_memory_bytes == 40 * 2**30


def test_wrong_values_name_field_value_and_choices(monkeypatch):
    with pytest.raises(ValueError, match=r"GradSyncConfig.defer='maybe'.*valid choices: True or False"):
        GradSyncConfig(defer="maybe")
    monkeypatch.setenv("ACCEL_GRADSYNC_DEFER", "2")
    with pytest.raises(ValueError, match=r"ACCEL_GRADSYNC_DEFER='2'.*valid choices"):
        GradSyncConfig()
    monkeypatch.delenv("ACCEL_GRADSYNC_DEFER")
    with pytest.raises(ValueError, match=r"GradSyncConfig.free_memory='0.5' must be an absolute size"):
        GradSyncConfig(sync_mode="auto", free_memory="0.5")
    with pytest.raises(ValueError, match=r"memory_budget='-1GiB' is not a memory size"):
        GradSyncConfig(sync_mode="budget", memory_budget="-1GiB")
    with pytest.raises(ValueError, match=r"sync_mode='budget' needs a memory budget"):
        GradSyncConfig(sync_mode="budget")
    with pytest.raises(ValueError, match=r"defer=True and GradSyncConfig.sync_mode='auto' contradict"):
        GradSyncConfig(defer=True, sync_mode="auto")
    with pytest.raises(SystemExit):
        HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses(["--defer-grad-sync", "maybe"])


def _recipe_parser():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / "grpo.py"
    spec = importlib.util.spec_from_file_location("recipe_grpo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.make_parser()


def test_recipe_command_line_and_yaml_agree_with_the_dataclass(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = _recipe_parser()
    (*_, from_cli) = parser.parse_args_and_config([])
    assert from_cli == GradSyncConfig()
    yaml_file = tmp_path / "recipe.yaml"
    yaml_file.write_text("output_dir: /tmp/unused\n")  # a recipe YAML that does not mention the plugin
    (*_, from_yaml) = parser.parse_args_and_config(["--config", str(yaml_file)])
    assert dataclasses.asdict(from_yaml) == DEFAULTS
    yaml_file.write_text("defer: true\nsync_mode: deferred\n")
    (*_, deferred) = parser.parse_args_and_config(["--config", str(yaml_file)])
    assert deferred.mode == "deferred"
