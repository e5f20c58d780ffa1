"""`GradSyncConfig` holds every default once; each entry point agrees with it and validates."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
from transformers import HfArgumentParser
from trl import TrlParser

from accel_gradsync import GradSyncConfig
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import DEFAULTS, ENV_PREFIX, spelled

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
    with pytest.raises(
        ValueError, match=r"GradSyncConfig.defer='maybe' is not a valid value for `defer`; a boolean is one of"
    ):
        GradSyncConfig(defer="maybe")
    monkeypatch.setenv("ACCEL_GRADSYNC_DEFER", "2")
    with pytest.raises(
        ValueError, match=r"ACCEL_GRADSYNC_DEFER='2' is not a valid value for `defer`; a boolean is one of"
    ):
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


def test_the_forecast_shape_is_two_whole_numbers_given_together(monkeypatch):
    resolved = GradSyncConfig(sync_mode="auto", forecast_micro_batch_size=4, forecast_seq_len=512).resolved()
    assert resolved.forecasts and (resolved.forecast_micro_batch_size, resolved.forecast_seq_len) == (4, 512)
    assert not GradSyncConfig(sync_mode="auto").resolved().forecasts
    with pytest.raises(ValueError, match=r"forecast_micro_batch_size=4: .* also set --grad-sync-forecast-seq-len"):
        GradSyncConfig(sync_mode="auto", forecast_micro_batch_size=4)
    monkeypatch.setenv("ACCEL_GRADSYNC_FORECAST_SEQ_LEN", "1.5")
    with pytest.raises(ValueError, match=r"FORECAST_SEQ_LEN='1.5' is not a valid `forecast_seq_len`; use a whole"):
        GradSyncConfig(sync_mode="auto")
    monkeypatch.setenv("ACCEL_GRADSYNC_FORECAST_SEQ_LEN", "512")
    with pytest.raises(ValueError, match=r"ACCEL_GRADSYNC_FORECAST_SEQ_LEN=512: .* --grad-sync-forecast-micro-batch"):
        GradSyncConfig(sync_mode="auto")
    parsed = HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses(
        ["--grad-sync-mode", "auto", "--grad-sync-forecast-micro-batch-size", "2"]
    )[0]
    assert (parsed.forecast_micro_batch_size, parsed.forecast_seq_len) == (2, 512)  # the environment fills in


REPO = Path(__file__).resolve().parents[3]


def _recipe():
    import importlib.util
    import sys

    if "recipe_grpo" in sys.modules:
        return sys.modules["recipe_grpo"]
    if str(REPO / "recipes") not in sys.path:
        sys.path.insert(0, str(REPO / "recipes"))  # as running the script does: it imports `embedded` beside it
    spec = importlib.util.spec_from_file_location("recipe_grpo", REPO / "recipes" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _recipe_parser():
    return _recipe().make_parser()


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


@pytest.fixture
def recipe(monkeypatch):
    """The recipe's module; GRPOConfig sets up accelerate's process-wide state while it is parsed,
    which must not leak into the next test."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield _recipe()
    AcceleratorState._reset_state(reset_partial_state=True)


def _recipe_grad_sync(recipe, tmp_path, args=(), yaml=None):
    """The recipe's GradSyncConfig from a command line and, given, a recipe YAML's text."""
    if yaml is not None:
        (tmp_path / "recipe.yaml").write_text(yaml)
        args = ["--config", str(tmp_path / "recipe.yaml"), *args]
    return recipe.parse_args(recipe.make_parser(), [*args, "--output_dir", str(tmp_path / "out")])[3]


def _set_environment(monkeypatch, environment):
    for name, value in environment.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)


# (environment, explicit settings, the mode they select): an explicit value outranks the
# environment, whichever of defer, sync_mode and memory_budget each one sets.
PRECEDENCE = [
    ({"DEFER": "1"}, {"sync_mode": "per_micro_batch"}, "per_micro_batch"),
    ({"DEFER": "1"}, {"sync_mode": "auto"}, "auto"),
    ({"SYNC_MODE": "budget"}, {"defer": True}, "deferred"),
    ({"SYNC_MODE": "auto"}, {"defer": True}, "deferred"),
    ({"SYNC_MODE": "deferred"}, {"defer": False}, "per_micro_batch"),
    # A budget asks for budget mode at its own rank: above a mode from the environment, below one beside it.
    ({"SYNC_MODE": "auto"}, {"memory_budget": "1GiB"}, "budget"),
    ({"DEFER": "1"}, {"memory_budget": "1GiB"}, "budget"),
    ({"SYNC_MODE": "deferred"}, {"defer": False, "memory_budget": "1GiB"}, "budget"),
    ({"MEMORY_BUDGET": "1GiB"}, {"sync_mode": "auto"}, "auto"),
    ({"MEMORY_BUDGET": "1GiB"}, {"defer": True}, "deferred"),
    # Two values of the same rank that agree.
    ({"DEFER": "1", "SYNC_MODE": "deferred"}, {}, "deferred"),
    ({"DEFER": "0", "SYNC_MODE": "auto"}, {}, "auto"),
    ({}, {"defer": False, "sync_mode": "auto"}, "auto"),
    ({"DEFER": "1", "MEMORY_BUDGET": "1GiB"}, {}, "deferred"),
]


@pytest.mark.filterwarnings("ignore:accel_gradsync")  # an outranked memory budget is ignored, with a warning
@pytest.mark.parametrize(("environment", "explicit", "mode"), PRECEDENCE)
def test_an_explicit_value_outranks_the_environment(monkeypatch, environment, explicit, mode):
    _set_environment(monkeypatch, environment)
    config = GradSyncConfig(**explicit)
    assert config.mode == mode
    if mode != "deferred":
        assert config.defer is False  # an outranked defer=1 is not left claiming deferral


def _flags(explicit):
    flag = {"defer": "--defer-grad-sync", "sync_mode": "--grad-sync-mode", "memory_budget": "--grad-sync-memory-budget"}
    return [item for name, value in explicit.items() for item in (flag[name], str(value))]


@pytest.mark.filterwarnings("ignore:accel_gradsync")
@pytest.mark.parametrize(("environment", "explicit", "mode"), PRECEDENCE)
def test_the_recipe_command_line_and_yaml_outrank_the_environment(
    recipe, tmp_path, monkeypatch, environment, explicit, mode
):
    _set_environment(monkeypatch, environment)
    assert _recipe_grad_sync(recipe, tmp_path, _flags(explicit)).mode == mode
    if explicit:  # TRL refuses an empty YAML
        yaml = "".join(f"{name}: {value}\n" for name, value in explicit.items())
        assert _recipe_grad_sync(recipe, tmp_path, yaml=yaml).mode == mode
    (parsed,) = HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses(_flags(explicit))
    assert parsed.mode == mode


def test_two_values_of_the_same_rank_that_disagree_contradict(recipe, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"GradSyncConfig.defer=True and GradSyncConfig.sync_mode='auto' contradict"):
        GradSyncConfig(defer=True, sync_mode="auto")
    with pytest.raises(ValueError, match=r"GradSyncConfig.defer=True and GradSyncConfig.sync_mode='auto' contradict"):
        _recipe_grad_sync(recipe, tmp_path, ["--grad-sync-mode", "auto"], yaml="defer: true\n")
    _set_environment(monkeypatch, {"DEFER": "1", "SYNC_MODE": "per_micro_batch"})
    with pytest.raises(
        ValueError, match=r"ACCEL_GRADSYNC_DEFER=True and ACCEL_GRADSYNC_SYNC_MODE='per_micro_batch' contradict"
    ):
        GradSyncConfig()
    assert GradSyncConfig(defer=False).mode == "per_micro_batch"  # an explicit value settles it


@pytest.mark.parametrize(
    "settings", [{"keep_params_unsharded": False}, {"memory_budget": ""}, {"memory_margin": 0.1}, {"free_memory": ""}]
)
def test_a_setting_given_at_its_default_is_not_called_ignored(recipe, tmp_path, monkeypatch, settings):
    ((name, value),) = settings.items()
    flag = "--grad-sync-" + name.replace("_", "-")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert GradSyncConfig(**settings).mode == "per_micro_batch"
        _recipe_grad_sync(recipe, tmp_path, [f"{flag}={value}"])
        _recipe_grad_sync(recipe, tmp_path, yaml=f"{name}: {value!r}\n")
        monkeypatch.setenv(ENV_PREFIX + name.upper(), str(value))
        assert GradSyncConfig().mode == "per_micro_batch"
    assert [str(w.message) for w in caught if w.category is GradSyncWarning] == []


def test_a_setting_the_mode_does_not_read_warns_once(monkeypatch):
    with pytest.warns(GradSyncWarning) as record:
        GradSyncConfig(keep_params_unsharded=True)
    assert [str(w.message) for w in record] == [
        "accel_gradsync: GradSyncConfig.keep_params_unsharded=True is ignored in sync mode 'per_micro_batch'; "
        "it applies to: deferred, budget, auto."
    ]
    monkeypatch.setenv("ACCEL_GRADSYNC_MEMORY_MARGIN", "0.2")
    with pytest.warns(GradSyncWarning, match=r"ACCEL_GRADSYNC_MEMORY_MARGIN=0.2 is ignored in sync mode 'deferred'"):
        GradSyncConfig(defer=True)


TRUE_SPELLINGS = ["1", "true", "True", "TRUE", "yes", "Yes", "on", "On", "ON", "y", "t"]
FALSE_SPELLINGS = ["0", "false", "False", "no", "No", "off", "Off", "OFF", "n", "f"]
BAD_SPELLINGS = ["maybe", "2", "-1", "", "tru", "onn", "1.0"]


def _boolean_from_every_source(recipe, tmp_path, monkeypatch, spelling):
    """`log_all_counters` from the environment, a command line (HfArgumentParser, TrlParser, the
    recipe's) and a recipe YAML (the value as written, then quoted): each answer, or the error."""
    answers = []

    def answer(read):
        try:
            answers.append(read().log_all_counters)
        except (ValueError, SystemExit) as error:
            answers.append(error)

    flag = ["--grad-sync-log-all-counters", spelling]
    with monkeypatch.context() as env:
        env.setenv("ACCEL_GRADSYNC_LOG_ALL_COUNTERS", spelling)
        answer(GradSyncConfig)
    for parser_cls in (HfArgumentParser, TrlParser):
        answer(lambda parser_cls=parser_cls: parser_cls(GradSyncConfig).parse_args_into_dataclasses(flag)[0])
    answer(lambda: _recipe_grad_sync(recipe, tmp_path, flag))
    if spelling:  # an empty unquoted YAML value is null: the setting is absent
        answer(lambda: _recipe_grad_sync(recipe, tmp_path, yaml=f"log_all_counters: {spelling}\n"))
    answer(lambda: _recipe_grad_sync(recipe, tmp_path, yaml=f'log_all_counters: "{spelling}"\n'))
    return answers


@pytest.mark.parametrize("spelling", TRUE_SPELLINGS + FALSE_SPELLINGS)
def test_every_source_reads_a_boolean_the_same_way(recipe, tmp_path, monkeypatch, spelling):
    expected = spelling in TRUE_SPELLINGS
    assert _boolean_from_every_source(recipe, tmp_path, monkeypatch, spelling) == [expected] * 6


@pytest.mark.parametrize("spelling", BAD_SPELLINGS)
def test_every_source_rejects_the_same_bad_boolean_with_one_message(recipe, tmp_path, monkeypatch, capsys, spelling):
    answers = _boolean_from_every_source(recipe, tmp_path, monkeypatch, spelling)
    assert all(isinstance(a, (ValueError, SystemExit)) for a in answers), answers
    explanation = "is not a valid value{}; a boolean is one of true/false, yes/no, on/off, y/n, t/f or 1/0 (any case)."
    for error in answers:
        if isinstance(error, ValueError):  # the environment, the recipe's command line and its YAML
            said = str(error)
            assert explanation.format("") in said or explanation.format(" for `log_all_counters`") in said, said
    exits = [a for a in answers if isinstance(a, SystemExit)]  # HfArgumentParser's and TrlParser's
    assert [e.code for e in exits] == [2] * len(exits)
    assert capsys.readouterr().err.count(f"{spelling!r} {explanation.format('')}") == len(exits)


def test_readme_lists_the_boolean_spellings_every_source_accepts():
    readme = (REPO / "README.md").read_text()
    for spelling in {s.lower() for s in TRUE_SPELLINGS + FALSE_SPELLINGS}:
        assert f"`{spelling}`" in readme.split("## Settings")[1].split("\n## ")[0], spelling


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("defer_grad_sync", "defer"),
        ("defer-grad-sync", "defer"),
        ("grad_sync_mode", "sync_mode"),
        ("grad-sync-memory-budget", "memory_budget"),
        ("grad_sync_memory_budgte", "memory_budget"),
    ],
)
def test_a_yaml_key_spelled_as_its_flag_suggests_the_key(recipe, tmp_path, key, field):
    with pytest.raises(ValueError, match=rf"--config YAML: '{key}' \(did you mean {field}[?,]"):
        _recipe_grad_sync(recipe, tmp_path, yaml=f"{key}: 1\n")


@pytest.mark.parametrize("name", ["keep_reference_unsharded", "keep_frozen_unsharded"])
@pytest.mark.parametrize(
    ("given", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("on", "true"), ("1", "true"), ("No", "false")]
)
def test_a_residency_setting_is_auto_or_a_boolean_from_every_source(
    recipe, tmp_path, monkeypatch, name, given, expected
):
    """A tri-state: auto (budget and auto decide from the bytes) or forced by any boolean spelling,
    read the same by the environment, both parsers, the recipe's command line and its YAML; a bare
    flag means true."""
    option = "--grad-sync-" + name.replace("_", "-")
    flag = [option, given]
    answers = [getattr(GradSyncConfig(**{name: given}), name)]
    with monkeypatch.context() as env:
        env.setenv("ACCEL_GRADSYNC_" + name.upper(), given)
        answers.append(getattr(GradSyncConfig(), name))
    for parser_cls in (HfArgumentParser, TrlParser):
        answers.append(getattr(parser_cls(GradSyncConfig).parse_args_into_dataclasses(flag)[0], name))
    answers.append(getattr(_recipe_grad_sync(recipe, tmp_path, flag), name))
    answers.append(getattr(_recipe_grad_sync(recipe, tmp_path, yaml=f'{name}: "{given}"\n'), name))
    assert answers == [expected] * 6
    bare = HfArgumentParser(GradSyncConfig).parse_args_into_dataclasses([option])[0]
    assert getattr(bare, name) == "true"
    assert getattr(GradSyncConfig(), name) == DEFAULTS[name] == "auto"


def test_a_bad_keep_reference_unsharded_names_the_choices():
    with pytest.raises(ValueError) as error:
        GradSyncConfig(keep_reference_unsharded="sometimes")
    assert str(error.value) == (
        "GradSyncConfig.keep_reference_unsharded='sometimes' is not a valid `keep_reference_unsharded`; use auto "
        "(budget and auto modes decide from the bytes) or a boolean (true/false, yes/no, on/off, y/n, t/f or 1/0 "
        "(any case))."
    )


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"sync_mode": "budget", "memory_budget": "512MiB", "free_memory": "40GiB"},
        {"sync_mode": "budget", "memory_budget": "0.25", "keep_frozen_unsharded": "true"},
        {"sync_mode": "auto", "keep_reference_unsharded": "false", "memory_margin": 0.2},
    ],
)
def test_spelled_settings_resolve_back_to_themselves(given):
    """A child process (auto's forecast) gets the settings spelled, JSON and all, and resolves them
    to the same typed values."""
    resolved = GradSyncConfig(**given).resolved()
    spelled_back = json.loads(json.dumps(spelled(resolved)))
    assert GradSyncConfig(**spelled_back).resolved() == resolved
