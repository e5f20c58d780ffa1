"""What `recipes/grpo.py` needs besides TRL's script shape: reading and refusing its input, and
the whole-model save at the end.

- The command line and the recipe YAML: `RecipeParser` (parse errors raised, not printed with the
  usage), `parse_args` (unknown flags and YAML keys named with a did-you-mean), `check_config_file`
  (a YAML that cannot be read or parsed), `rewrite_help` (what the recipe's own defaults mean).
- The settings' checks: `check_training_settings`, `check_save_steps_used`, `check_warm_up`.
- The data: `resolve_rewards` (names to reward functions) and `load_prompts` (a hub name, a
  `save_to_disk` folder, a .json/.jsonl/.csv/.parquet file or the built-in set).
- How a refusal is reported: `exit_on_setting_error` (one line from the main process, exit 2) and
  `warn_once` (one warning per launch).
- `save_model_whole`: the final save, moved into output_dir only once every rank has written it.

Each refusal is a ValueError naming the setting, the value and what to do, raised before the model
is loaded or anything is written: what would otherwise fail late (inside `train()`, after
output_dir exists) or half-way through a long run. The messages are the recipe's interface:
tests/recipes/test_recipe_errors.py (in-process) and tests/distributed/test_recipe_bad_input.py
(launched) match them, and docs/recipe.md quotes them. This module imports nothing of grpo.py.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
import time
import warnings
from typing import NoReturn

import embedded  # recipes/embedded.py: running a script puts its folder on sys.path
from trl import TrlParser

HELP = "python recipes/grpo.py --help"

# How long a rank other than the main process waits, after a setting error, for the launcher to stop
# it: every rank checks the same settings, so the main process reports the same error and the
# launcher stops the others when it exits. A rank that fails alone (a path missing on its node
# only) reports its error itself after this wait.
_PEER_WAIT_S = 30.0


# -- how a refusal is reported -------------------------------------------------------------------


class ParseError(ValueError):
    """A command line or YAML that does not parse; reported with a pointer to --help."""


def is_main_process() -> bool:
    """Rank 0 of the launch, or a process that was not launched as one of several."""
    return os.environ.get("RANK", "0") == "0"


def warn_once(message: str) -> None:
    """One warning for the whole launch (the main process's), not one per rank."""
    if is_main_process():
        warnings.warn(message, UserWarning, stacklevel=3)


def exit_on_setting_error(error: ValueError) -> NoReturn:
    """Print `error` as one line from the main process (with a pointer to --help for a parse
    error) and exit 2; the other ranks say nothing unless the launcher leaves them running."""
    message = " ".join(str(error).split())  # one line, whatever the message was built from
    lines = [f"error: {message}"] + ([f"See `{HELP}` for every setting."] if isinstance(error, ParseError) else [])
    if not is_main_process():
        time.sleep(_PEER_WAIT_S)  # normally ends by the launcher's SIGTERM, see _PEER_WAIT_S
        lines = [f"[rank {os.environ.get('RANK')}] {line}" for line in lines]
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(2)


# -- the command line and the recipe YAML --------------------------------------------------------


class RecipeParser(TrlParser):
    """TrlParser whose parse errors are raised (`ParseError`), not printed with the full
    usage and exited on: under `accelerate launch` every rank would print the ~200 lines of usage."""

    def error(self, message: str):  # argparse's documented hook for parse errors
        raise ParseError(message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: each setting's default (as HfArgumentParser shows it), the description as written."""


def rewrite_help(parser: TrlParser, save_on_signal: str) -> None:
    """What `auto` and the recipe's own save_on_signal default mean, in --help (GRPOConfig's and
    GradSyncConfig's texts predate them)."""
    for action in parser._actions:
        if action.dest == "save_on_signal":  # the recipe's default, set through the environment in run()
            action.help = action.help.replace("Default: 'none'", f"Default (this recipe): {save_on_signal!r}")
        if action.dest == "resume_from_checkpoint":
            action.help = (
                "A checkpoint-<step> folder to resume from, or 'auto': the newest complete checkpoint in "
                "--output_dir if there is one, else a fresh start (the same command starts and restarts a run)."
            )


def parse_args(parser: TrlParser, args: list[str] | None = None):
    """`parse_args_and_config`, with errors that name the unknown flag or YAML key and what is close to it."""
    args = list(sys.argv[1:] if args is None else args)
    check_config_file(args)
    try:
        *parsed, from_yaml, from_cli = parser.parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ValueError as error:
        if "num_generations" in str(error):
            raise ValueError(
                f"{error} The generation batch is per_device_train_batch_size x processes x "
                "steps_per_generation (default: gradient_accumulation_steps); set --num_generations to "
                "a divisor of it, or change one of those."
            ) from error
        raise
    actions = [a for a in parser._actions if a.dest != "help"]
    flags = {o: o for a in actions for o in a.option_strings if o.startswith("--")}
    # A YAML key is a field's name; a key spelled as one of its flags (defer_grad_sync) points to it.
    yaml_keys = {o.lstrip("-").replace("-", "_"): a.dest for a in actions for o in a.option_strings} | {
        a.dest: a.dest for a in actions
    }
    for source, remaining, valid in (
        ("the --config YAML", from_yaml, yaml_keys),
        ("the command line", from_cli, flags),
    ):
        unknown = [s.split("=")[0] for s in remaining if s.startswith("-")] or remaining
        if valid is yaml_keys:
            unknown = [k.removeprefix("--") for k in unknown]  # TrlParser hands YAML keys back as flags
        if unknown:
            raise ValueError(
                f"Unknown setting(s) in {source}: "
                + "; ".join(f"{k!r}" + _suggest_settings(k, valid) for k in unknown)
                + ". Valid settings are the fields of GRPOScriptArguments, GRPOConfig, ModelConfig and "
                "GradSyncConfig: see `python recipes/grpo.py --help`."
            )
    return parsed


def check_config_file(args: list[str]) -> None:
    """Refuse a `--config` file that cannot be read or is not YAML, naming it (TrlParser would
    raise the OSError or yaml's error from inside its parsing)."""
    import yaml

    if "--config" not in args:
        return
    index = args.index("--config") + 1
    if index == len(args) or args[index].startswith("--"):
        raise ParseError("--config: expected the path of a recipe YAML file after it.")
    path = args[index]
    try:
        with open(path) as f:
            yaml.safe_load(f)
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror}).") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path}: not valid YAML ({_describe_yaml_problem(error)}).") from None


def _describe_yaml_problem(error) -> str:
    """Where and what, in one line: `line 2, column 16: expected ',' or ']', but got ...`."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or problem is None:
        return str(error)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _suggest_settings(name: str, valid: dict[str, str]) -> str:
    """Did you mean: up to 3 suggestions for an unknown `name`. `valid` maps each spelling close to
    it to the setting to suggest, so several spellings of one setting make one suggestion."""
    if name.replace("-", "_") in valid:  # a YAML key written with dashes, or as a flag is spelled
        return f" (did you mean {valid[name.replace('-', '_')]}?)"
    close = difflib.get_close_matches(name, list(valid), n=6, cutoff=0.7)
    suggestions = list(dict.fromkeys(valid[c] for c in close))[:3]
    return f" (did you mean {', '.join(suggestions)}?)" if suggestions else ""


# -- the settings' checks ------------------------------------------------------------------------

_COUNTS = {
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "per_device_train_batch_size": "completions per device per micro-batch",
}


def check_warm_up(script_args, model_args, default_steps: int) -> None:
    """The built-in model's warm-up steps: never negative, and a warning where a model path makes
    them unused."""
    if script_args.sft_warmup_steps < 0:
        raise ValueError(f"--sft_warmup_steps {script_args.sft_warmup_steps}: must be >= 0 (0 skips the warm-up).")
    if model_args.model_name_or_path is not None and script_args.sft_warmup_steps != default_steps:
        warn_once(
            f"--sft_warmup_steps {script_args.sft_warmup_steps} is ignored with --model_name_or_path: "
            "it warms up only the built-in tiny model."
        )


def check_training_settings(training_args) -> None:
    """Counts that must be positive (`--max_steps` -1 means "by epochs"), and a save interval that
    must not be silently unused."""
    for name in _COUNTS:
        value = getattr(training_args, name)
        if value < 1:
            raise ValueError(f"--{name} {value}: must be >= 1 ({_COUNTS[name]}).")
    if training_args.max_steps == 0:  # transformers reads 0 as a step count and still trains and saves
        raise ValueError(
            "--max_steps 0: must be >= 1 (optimizer steps), or -1 to train for --num_train_epochs "
            f"({training_args.num_train_epochs:g})."
        )
    strategy = str(getattr(training_args.save_strategy, "value", training_args.save_strategy))
    if strategy == "steps" and training_args.save_steps <= 0:
        raise ValueError(
            f"--save_steps {training_args.save_steps:g}: must be > 0 with --save_strategy steps "
            "(or set --save_strategy no to save only at the end)."
        )


def check_save_steps_used(training_args, default_save_steps: float) -> None:
    """A --save_steps that the save strategy does not read gets one warning."""
    strategy = str(getattr(training_args.save_strategy, "value", training_args.save_strategy))
    if strategy != "steps" and training_args.save_steps != default_save_steps:
        warn_once(
            f"--save_steps {training_args.save_steps:g} is ignored with --save_strategy {strategy}; "
            "set --save_strategy steps to save every N steps."
        )


# -- the rewards and the prompts -----------------------------------------------------------------


def resolve_rewards(names: list[str]) -> list:
    """The reward functions `--reward_funcs` names (recipes/embedded.py's REWARD_FUNCS)."""
    unknown = [n for n in names if n not in embedded.REWARD_FUNCS]
    if unknown or not names:
        raise ValueError(
            f"--reward_funcs {' '.join(names) or '(empty)'}: unknown reward function(s) {unknown}; "
            f"valid choices: {', '.join(embedded.REWARD_FUNCS)}."
        )
    return [embedded.REWARD_FUNCS[n] for n in names]


def load_prompts(script_args):
    """The train split with `prompt` and `answer` columns, from the hub, a local path or the built-in set."""
    if script_args.dataset_name is None:
        return embedded.build_dataset()
    from datasets import DatasetDict, load_dataset, load_from_disk

    name = script_args.dataset_name
    local = _classify_local_dataset(name)
    if local is not None and script_args.dataset_config is not None:
        warn_once(
            f"--dataset_config {script_args.dataset_config} is ignored: --dataset_name {name} is a local "
            f"{local}, which has no configurations."
        )
    if local == "save_to_disk folder":
        data = load_from_disk(name)
    elif local is not None:
        data = _load_data_file(name, local)
    else:
        data = load_dataset(name, name=script_args.dataset_config)
    if isinstance(data, DatasetDict):
        split = script_args.dataset_train_split
        if split not in data:
            raise ValueError(
                f"--dataset_train_split {split!r}: dataset {name!r} has no such split; valid choices: "
                f"{', '.join(data)}."
            )
        data = data[split]
    if len(data) == 0:
        raise ValueError(f"--dataset_name {name}: the dataset has no rows; give one with a row per prompt.")
    needed = {"prompt": script_args.prompt_column, "answer": script_args.answer_column}
    for role, column in needed.items():
        if column not in data.column_names:
            raise ValueError(
                f"--{role}_column {column!r}: dataset {name!r} has no column {column!r} (it has: "
                f"{', '.join(data.column_names)}). Set --{role}_column to the column that holds the {role}."
            )
    renames = {column: role for role, column in needed.items() if column != role}
    return data.rename_columns(renames) if renames else data


# Local data files the recipe reads, by extension: the `datasets` builder for each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _load_data_file(name: str, extension: str):
    """The data file as a dataset, through its format's `datasets` builder (the file is the train
    split), or a ValueError naming the file when there are no rows to read or datasets cannot
    read them."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    if _is_blank(name):  # datasets raises StopIteration or "corresponds to no data" for these
        raise ValueError(
            f"--dataset_name {name}: the file is empty; give a {extension} file with one row per prompt "
            "(a prompt and an answer column)."
        )
    try:
        return load_dataset(DATA_FILE_BUILDERS[extension], data_files={"train": name})
    except (DatasetGenerationError, ValueError, StopIteration) as error:
        cause = error.__cause__ or error
        raise ValueError(
            f"--dataset_name {name}: datasets cannot read it as a {extension} file ({type(cause).__name__}: "
            f"{cause}). Fix the file, or give a save_to_disk folder or a hub dataset name."
        ) from None


def _is_blank(path: str) -> bool:
    """True when the file holds nothing but whitespace (read until the first other byte)."""
    with open(path, "rb") as f:
        return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def _classify_local_dataset(name: str) -> str | None:
    """`save_to_disk folder`, a data file extension, or None for a hub name / load_dataset path."""
    if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json")):
        return "save_to_disk folder"
    extension = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if extension not in DATA_FILE_BUILDERS:
            raise ValueError(
                f"--dataset_name {name}: a file the recipe cannot read; give a {', '.join(DATA_FILE_BUILDERS)} "
                "file, a `save_to_disk` folder or a hub dataset name."
            )
        return extension
    if extension in DATA_FILE_BUILDERS and "://" not in name:  # a local file name, of a file that is not there
        raise ValueError(
            f"--dataset_name {name}: no such file. Give an existing {extension} file, a `save_to_disk` folder "
            "or a hub dataset name."
        )
    return None


# -- the final save ------------------------------------------------------------------------------


def save_model_whole(trainer, output_dir: str) -> None:
    """`trainer.save_model(output_dir)`, written to a staging folder beside output_dir and moved
    in only once every rank has finished: a run stopped while saving (Ctrl-C, a killed rank)
    leaves no half-written weights in output_dir."""
    accelerator = trainer.accelerator
    staging = os.path.normpath(output_dir) + ".saving"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # what an earlier killed run left
        accelerator.wait_for_everyone()
        trainer.save_model(staging)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            # FSDP1 on CPU saves a sharded state dict, which writes nothing here (README).
            for name in os.listdir(staging) if os.path.isdir(staging) else ():
                target = os.path.join(output_dir, name)
                if os.path.isdir(target):  # FSDP1's sharded state dict is a folder
                    shutil.rmtree(target)
                os.replace(os.path.join(staging, name), target)
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
