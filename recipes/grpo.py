r"""GRPO with TRL's `GRPOTrainer`, gradient sync chosen by accel_gradsync.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync

With no other flag it trains the built-in default (`recipes/embedded.py`): a tiny Qwen2-style
model with random weights, a local character tokenizer and `a+b=` prompts, rewarded for the
right sum and for answering with a bare number; no hub access needed. A real model and dataset
are one flag each, or a recipe YAML:

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py \
        --config recipes/qwen2.5-0.5b-gsm8k.yaml --defer-grad-sync

The fastest step where memory allows (FSDP2): each unit all-gathers once per GRPO step instead of
once per generated token, at the cost of its unsharded parameters and gradients on every rank
from generation to the step's last backward:

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py \
        --defer-grad-sync --grad-sync-keep-params-unsharded

Every field of the script arguments, `GRPOConfig`, `ModelConfig` and `GradSyncConfig` is a flag
and a YAML key (`python recipes/grpo.py --help`). A checkpoint is saved every --save_steps (100)
steps; `--resume_from_checkpoint auto` continues from the newest complete one. On a machine with
no GPU/NPU the FSDP configs run as real FSDP over gloo with the processes the config names.

Preemption: on SIGTERM (--grad-sync-save-on-signal SIGUSR1 for `sbatch --signal=USR1@120`; none:
die at once) every rank finishes the optimizer step it is in, a complete checkpoint is saved
there and every process exits with code 75 (accel_gradsync.PREEMPTED_EXIT_CODE), without the
final save; the same command with `--resume_from_checkpoint auto` continues from that step
(docs/recipe.md, Preemption).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, NoReturn

import embedded  # recipes/embedded.py: running a script puts its folder on sys.path
from trl import (
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)

import accel_gradsync
from accel_gradsync.compat.cpu import has_accelerator_device
from accel_gradsync.compat.releases import training_arg
from accel_gradsync.config.settings import ENV_PREFIX
from accel_gradsync.launch import check_restart, launch_setup
from accel_gradsync.runtime import resume

# The recipe's defaults, sized for the embedded model on a few CPU cores; a YAML or a flag
# overrides each (see recipes/qwen2.5-0.5b-gsm8k.yaml for real-model values).
RECIPE_DEFAULTS = dict(
    output_dir="runs/grpo",
    max_steps=500,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,  # M micro-batches per optimizer step: what --defer-grad-sync defers over
    # 8 completions per prompt and a moderate rate keep the groups' rewards apart: with 4 and 3e-3
    # the policy collapsed to one answer per prompt by step ~110 and the gradient went to zero.
    num_generations=8,
    max_completion_length=8,
    learning_rate=5e-4,
    lr_scheduler_type="constant",
    logging_steps=10,
    # A checkpoint every 100 steps (each one resumable, see --resume_from_checkpoint auto);
    # --save_steps alone changes the interval.
    save_strategy="steps",
    save_steps=100,
    report_to="none",
    # Two small layers gain nothing from recomputing activations (TRL turns it on by default, under
    # transformers' deprecated name `gradient_checkpointing`, its only one before 5.23); the
    # real-model YAML turns it on.
    **{training_arg("activation_checkpointing"): False},
)


SFT_WARMUP_STEPS = 100
# The recipe saves on SIGTERM unless the command line, the YAML or the environment says otherwise
# (GradSyncConfig.save_on_signal; the plugin's own default leaves a Trainer's signals alone).
RECIPE_SAVE_ON_SIGNAL = "SIGTERM"
SAVE_ON_SIGNAL_ENV = ENV_PREFIX + "SAVE_ON_SIGNAL"


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Where the prompts and rewards come from (the model comes from `ModelConfig`)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset name or local path: a `save_to_disk` folder, a .json/.jsonl/.csv/.parquet "
            "file (its rows are the train split) or a `load_dataset` path. Default: the built-in `a+b=` prompts."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Dataset column holding the prompt."})
    answer_column: str = field(
        default="answer",
        metadata={"help": "Dataset column holding the reference answer (its last number is the target)."},
    )
    sft_warmup_steps: int = field(
        default=SFT_WARMUP_STEPS,
        metadata={
            "help": "Supervised warm-up steps of the built-in tiny model before GRPO (about 2 s for "
            "100; 0: start GRPO from random weights). Ignored with --model_name_or_path."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={"help": f"Reward functions, any of: {', '.join(embedded.REWARD_FUNCS)}."},
    )


@dataclass
class PreparedRun:
    """The parsed settings once `prepare` has checked them, and what it loaded for `train`."""

    script_args: GRPOScriptArguments
    training_args: GRPOConfig
    model_args: ModelConfig
    grad_sync_args: accel_gradsync.GradSyncConfig
    reward_funcs: list
    dataset: Any
    resume: str | None
    """The checkpoint folder to resume from; None: a fresh start."""


def main(script_args, training_args, model_args, grad_sync_args):
    train(prepare(script_args, training_args, model_args, grad_sync_args))


def prepare(script_args, training_args, model_args, grad_sync_args) -> PreparedRun:
    """Everything that can be wrong with the settings, checked before the model is loaded or
    anything is written to output_dir (a ValueError naming the setting); returns what `train` needs."""
    reward_funcs = resolve_rewards(script_args.reward_funcs)
    if script_args.sft_warmup_steps < 0:
        raise ValueError(f"--sft_warmup_steps {script_args.sft_warmup_steps}: must be >= 0 (0 skips the warm-up).")
    if model_args.model_name_or_path is not None and script_args.sft_warmup_steps != SFT_WARMUP_STEPS:
        warn_once(
            f"--sft_warmup_steps {script_args.sft_warmup_steps} is ignored with --model_name_or_path: "
            "it warms up only the built-in tiny model."
        )
    check_training_settings(training_args)
    check_save_steps_used(training_args, RECIPE_DEFAULTS["save_steps"])
    accel_gradsync.check_launch(grad_sync_args)  # the sync mode against the accelerate config
    resume_from = resume.resolve_resume(
        training_args.resume_from_checkpoint, training_args.output_dir, launch_setup().processes
    )
    dataset = load_prompts(script_args)
    return PreparedRun(script_args, training_args, model_args, grad_sync_args, reward_funcs, dataset, resume_from)


def train(prepared: PreparedRun) -> None:
    # The built-in model's folder (see load_policy), this rank's own, removed when the run ends.
    with tempfile.TemporaryDirectory(prefix="grpo-embedded-model-") as folder:
        model, tokenizer = load_policy(prepared, folder)
        run_trainer(prepared, model, tokenizer)


def load_policy(prepared: PreparedRun, folder: str) -> tuple[Any, Any]:
    """The model and tokenizer to give GRPOTrainer: the built-in ones, or the path it loads both from.
    With `--beta` above 0 TRL builds the reference model with `from_pretrained` of the policy's
    `name_or_path`, so the built-in model is saved to `folder` and loaded back from it first."""
    script_args, training_args, model_args = prepared.script_args, prepared.training_args, prepared.model_args
    if model_args.model_name_or_path is not None:
        # As TRL's own scripts/grpo.py; GRPOTrainer adds GRPOConfig's trust_remote_code itself.
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
            **(training_args.model_init_kwargs or {}),
        }
        return model_args.model_name_or_path, None  # GRPOTrainer loads both
    from transformers import set_seed

    set_seed(training_args.seed)  # every rank must build the same random weights
    tokenizer = embedded.build_tokenizer()
    model = embedded.build_model(tokenizer)
    if script_args.sft_warmup_steps > 0:  # from random weights GRPO collapses onto one answer
        embedded.warm_up(model, tokenizer, script_args.sft_warmup_steps)
    if training_args.beta != 0.0:
        model = embedded.reload_from(model, folder)
    return model, tokenizer


def run_trainer(prepared: PreparedRun, model: Any, tokenizer: Any) -> None:
    training_args, model_args = prepared.training_args, prepared.model_args
    save_total_limit = resume.take_over_rotation(training_args)  # deleted once the new one is marked
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=prepared.reward_funcs,
        args=training_args,
        train_dataset=prepared.dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.add_callback(resume.MarkCheckpointComplete(trainer.accelerator, save_total_limit))
    accel_gradsync.attach(trainer, prepared.grad_sync_args)
    if prepared.resume is not None:
        trainer.accelerator.print(f"Resuming from {prepared.resume}.")
    trainer.train(resume_from_checkpoint=prepared.resume)
    save_model_whole(trainer, training_args.output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Model and trainer state saved to {training_args.output_dir}.")
    trainer.accelerator.end_training()


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


def resolve_rewards(names: list[str]) -> list:
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
    local = _local_dataset_kind(name)
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


def _local_dataset_kind(name: str) -> str | None:
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


# -- the settings' checks, and how a refusal is reported ---------------------------------------
# Each refusal is a ValueError naming the setting, the value and what to do, raised before the
# model is loaded or anything is written: what would otherwise fail late (inside `train()`, after
# output_dir exists) or half-way through a long run. `exit_on_setting_error` prints it as one line.

HELP = "python recipes/grpo.py --help"

# How long a rank other than the main process waits, after a setting error, for the launcher to stop
# it: every rank checks the same settings, so the main process reports the same error and the
# launcher stops the others when it exits. A rank that fails alone (a path missing on its node
# only) reports its error itself after this wait.
_PEER_WAIT_S = 30.0


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


_COUNTS = {
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "per_device_train_batch_size": "completions per device per micro-batch",
}


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


class RecipeParser(TrlParser):
    """TrlParser whose parse errors are raised (`ParseError`), not printed with the full
    usage and exited on: under `accelerate launch` every rank would print the ~200 lines of usage."""

    def error(self, message: str):  # argparse's documented hook for parse errors
        raise ParseError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: each setting's default (as HfArgumentParser shows it), the description as written."""


def make_parser(cpu_fsdp: bool = False) -> TrlParser:
    parser = RecipeParser(
        (GRPOScriptArguments, GRPOConfig, ModelConfig, accel_gradsync.GradSyncConfig),
        description=__doc__,  # the launch commands, the fastest one included, above the settings
        formatter_class=_HelpFormatter,
    )
    parser.set_defaults(**RECIPE_DEFAULTS)
    if not has_accelerator_device():
        # GRPOConfig's bf16 default asks for a GPU; pinned host memory needs one too.
        parser.set_defaults(bf16=False, dataloader_pin_memory=False)
    if cpu_fsdp:
        # GRPOConfig sets up accelerate's state while it is parsed; without this it would discard
        # the FSDP state enable_cpu_fsdp() built (a YAML/CLI `accelerator_config` must keep it).
        parser.set_defaults(accelerator_config={"use_configured_state": True})
    for action in parser._actions:  # what `auto` means, in --help (GRPOConfig's text predates it)
        if action.dest == "save_on_signal":  # the recipe's default, set through the environment in run()
            action.help = action.help.replace("Default: 'none'", f"Default (this recipe): {RECIPE_SAVE_ON_SIGNAL!r}")
        if action.dest == "resume_from_checkpoint":
            action.help = (
                "A checkpoint-<step> folder to resume from, or 'auto': the newest complete checkpoint in "
                "--output_dir if there is one, else a fresh start (the same command starts and restarts a run)."
            )
    return parser


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
                + "; ".join(f"{k!r}" + _did_you_mean(k, valid) for k in unknown)
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
        raise ValueError(f"--config {path}: not valid YAML ({_yaml_problem(error)}).") from None


def _yaml_problem(error) -> str:
    """Where and what, in one line: `line 2, column 16: expected ',' or ']', but got ...`."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or problem is None:
        return str(error)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _did_you_mean(name: str, valid: dict[str, str]) -> str:
    """Up to 3 suggestions for an unknown `name`: `valid` maps each spelling close to it to the
    setting to suggest, so several spellings of one setting make one suggestion."""
    if name.replace("-", "_") in valid:  # a YAML key written with dashes, or as a flag is spelled
        return f" (did you mean {valid[name.replace('-', '_')]}?)"
    close = difflib.get_close_matches(name, list(valid), n=6, cutoff=0.7)
    suggestions = list(dict.fromkeys(valid[c] for c in close))[:3]
    return f" (did you mean {', '.join(suggestions)}?)" if suggestions else ""


def run(argv: list[str] | None = None) -> None:
    """The script: settings checked before anything is built (a bad one ends the launch with one
    line from the main process, exit 2), then training."""
    # TRL 1.16's generation (`unwrap_model_for_generation`) reads transformers' deprecated
    # `is_gradient_checkpointing` every round; nothing in the user's settings changes that.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # Below an explicit value, as the environment sits (settings.py): the recipe's own default.
    os.environ.setdefault(SAVE_ON_SIGNAL_ENV, RECIPE_SAVE_ON_SIGNAL)
    try:
        check_restart()  # before parsing forms the process group, which a restart would not form again
        # On a machine without GPU/NPU, turn the FSDP config into real FSDP over gloo (a no-op on
        # GPU/NPU, or without an FSDP config); before parsing, which builds accelerate's state.
        cpu_fsdp = accel_gradsync.enable_cpu_fsdp()
        prepared = prepare(*parse_args(make_parser(cpu_fsdp), argv))
    except ValueError as error:
        exit_on_setting_error(error)
    train(prepared)


if __name__ == "__main__":
    run()
