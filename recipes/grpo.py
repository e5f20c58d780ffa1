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

import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import embedded  # recipes/embedded.py: running a script puts its folder on sys.path
from grpo_inputs import (
    HelpFormatter,
    RecipeParser,
    check_save_steps_used,
    check_training_settings,
    check_warm_up,
    exit_on_setting_error,
    load_prompts,
    parse_args,
    resolve_rewards,
    rewrite_help,
    save_model_whole,
)
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
from accel_gradsync.compat.releases import training_arg
from accel_gradsync.config.settings import ENV_PREFIX
from accel_gradsync.launch import check_restart, launch_setup
from accel_gradsync.runtime.faults import resume

# The shape of TRL's trl/scripts/grpo.py: the arguments' dataclasses, `make_parser`, `main` (`prepare`,
# then `train`) and `run`, the `__main__` block. What the script needs besides (reading and refusing
# its input, the whole-model save) is in recipes/grpo_inputs.py; the built-in model, tokenizer,
# prompts and rewards are in recipes/embedded.py.
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
    check_warm_up(script_args, model_args, SFT_WARMUP_STEPS)
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


def make_parser() -> TrlParser:
    parser = RecipeParser(
        (GRPOScriptArguments, GRPOConfig, ModelConfig, accel_gradsync.GradSyncConfig),
        description=__doc__,  # the launch commands, the fastest one included, above the settings
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(**RECIPE_DEFAULTS)
    # Without a GPU/NPU: no bf16, no pinned memory, and the FSDP state enable_cpu_fsdp() built kept
    # (GRPOConfig sets up accelerate's state while it is parsed); a flag or YAML key still wins.
    parser.set_defaults(**accel_gradsync.training_args_defaults())
    rewrite_help(parser, RECIPE_SAVE_ON_SIGNAL)
    return parser


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
        accel_gradsync.enable_cpu_fsdp()
        prepared = prepare(*parse_args(make_parser(), argv))
    except ValueError as error:
        exit_on_setting_error(error)
    train(prepared)


if __name__ == "__main__":
    run()
