"""`accel-gradsync` (also `python -m accel_gradsync`): commands run before launch.

`estimate` takes its sync settings from `GradSyncConfig` through `HfArgumentParser`, so its flags,
defaults and environment variables are exactly the recipe's and `attach`'s. Every flag is read and
checked before the estimate's model machinery (transformers' models, accelerate, PEFT, FSDP) is
imported, so a refusal is quick: one usage line and one error line, exit 2. With `--json` a
refusal is also `{"error": "<the error line's message>"}` on stdout, so a script that reads
stdout as JSON reads JSON either way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from accel_gradsync.compat.versions import TESTED_TORCH
from accel_gradsync.config.errors import GradSyncWarning
from accel_gradsync.config.settings import DTYPES, GradSyncConfig
from accel_gradsync.estimator.inputs import (
    MAX_MICRO_BATCHES,
    OPTIMIZERS,
    RECIPE_DEFAULT,
    check_micro_batches,
    check_processes,
    read_lora,
    read_step_shape,
)


@dataclass
class EstimateArguments:
    """What `accel-gradsync estimate` reads besides the sync settings."""

    micro_batches: int = field(
        metadata={
            "help": f"Micro-batches per optimizer step (gradient_accumulation_steps), 1 to {MAX_MICRO_BATCHES:,}."
        }
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "The accelerate config file the run will be launched with (FSDP version, wrap policy, "
            "mixed_precision, num_processes, parallelism_config replicate/shard sizes)."
        },
    )
    distributed_config: str | None = field(
        default=None,
        metadata={
            "help": "Instead of --accelerate-config, for a model transformers shards at load time: the keys "
            'of its DistributedConfig as JSON or a JSON/YAML file, e.g. \'{"fsdp_size": 8, '
            '"dp_replicate_size": 2}\' (fsdp_size, dp_replicate_size, fsdp_mixed_precision, '
            "fsdp_cpu_offload, fsdp_plan)."
        },
    )
    model: str = field(
        default=RECIPE_DEFAULT,
        metadata={
            "help": f"A transformers config: a local directory with config.json, a hub name (online only), "
            f"or {RECIPE_DEFAULT!r} for the GRPO recipe's embedded tiny Qwen2. Built on the meta device: "
            "no weights are loaded and no memory is spent."
        },
    )
    num_processes: int | None = field(
        default=None,
        metadata={"help": "Override the config's num_processes, as accelerate launch --num_processes does."},
    )
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "Override the config's mixed_precision, as accelerate launch --mixed_precision does.",
            "choices": ("no", "fp16", "bf16", "fp8"),
        },
    )
    model_dtype: str = field(
        default="fp32",
        metadata={
            "help": "dtype the model's parameters are loaded in. With mixed_precision on, accelerate upcasts "
            "trainable parameters to fp32 anyway.",
            "choices": tuple(DTYPES),
        },
    )
    json: bool = field(
        default=False,
        metadata={
            "help": "Print the estimate as JSON instead of a table. A refused input (exit 2) then prints "
            '{"error": "<message>"} on stdout, as well as the usage and error lines on stderr.'
        },
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Sequences per micro-batch. With --seq-len, each row also gets the whole optimizer step's "
            "peak bytes per rank (params, optimizer state, gradients, activations), simulated with torch's "
            "FSDPMemTracker on fake tensors (FSDP2 only)."
        },
    )
    seq_len: int | None = field(default=None, metadata={"help": "Tokens per sequence, for the step peak."})
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "Optimizer for the step peak: adamw (two fp32 moments per trainable param) or sgd (no state).",
            "choices": OPTIMIZERS,
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "For the step peak: the model runs with gradient checkpointing (non-reentrant)."},
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "For the step peak, GRPO: tokens generated per completion (the end of each --seq-len sequence). "
            "Adds a generation phase: micro-batch-size x micro-batches sequences per rank decoded token by token "
            "with their KV cache, units gathered as --grad-sync-gather-for-generation says. Not given: none."
        },
    )
    lora_r: int | None = field(
        default=None,
        metadata={
            "help": "A LoRA fine-tune (PEFT) of rank R: only the adapters train, so units, held gradients, optimizer "
            "state and the step peak are those of the adapters, the frozen base sharded, or, where "
            "--grad-sync-keep-frozen-unsharded keeps it for a row's mode (FSDP2), split from the adapters and kept "
            "unsharded for the run: gathered in step 1 only and counted in every step peak. Not given: full "
            "fine-tuning."
        },
    )
    lora_target_modules: str = field(
        default="",
        metadata={"help": "With --lora-r: comma-separated module names (default: PEFT's for the architecture)."},
    )
    num_generations: int | None = field(
        default=None,
        metadata={"help": "For the step peak, GRPO: completions per prompt, checked against the generation batch."},
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "GRPO with TRL's use_vllm (GRPOConfig use_vllm): vLLM generates, so the step peak has no "
            "generation phase (vLLM's memory is its own), and --grad-sync-keep-frozen-unsharded keeps no frozen "
            "unit (true is refused), as attach decides for such a Trainer."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "GRPO's KL coefficient (GRPOConfig beta). Above 0 TRL keeps a frozen reference model, sharded "
            "as one FSDP2 unit: the estimate adds its line (what a live run prints), its all-gathers per step with "
            "and without the plugin and its bytes, and its sharded params to every step peak; under --lora-r "
            "it is the policy with its adapter off (no second model). 0: no reference model."
        },
    )
    torch: str | None = field(
        default=None,
        metadata={
            "help": "The torch release series the cluster runs, when it is not this process's: the rows follow its "
            "FSDP2 dtype rules (2.15 holds and reduce-scatters gradients in the parameter's dtype where the "
            "mixed-precision policy sets no reduce dtype; 2.13 and 2.14 in the compute dtype). The header names "
            "the torch assumed. Default: this process's torch.",
            "choices": TESTED_TORCH,
        },
    )


class _EstimateParser(HfArgumentParser):
    """`estimate`'s parser: an error prints one usage line, not every flag (`--help` lists them),
    and one error line, whatever lines the message came in; with `json_errors`, the message also
    goes to stdout as `{"error": message}`."""

    json_errors = False

    def format_usage(self) -> str:
        return f"usage: {self.prog} --micro-batches M [OPTIONS] (--help lists them)\n"

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        if self.json_errors:
            print(json.dumps({"error": message}), flush=True)
        super().error(message)


class _Probe(argparse.ArgumentParser):
    """Reads one flag out of a command line it does not otherwise know; raises instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _asks_for_json(argv: Sequence[str]) -> bool:
    """Whether `estimate ARGV` asks for --json, read as its parser reads the flag (`--json`,
    `--json true`, `--json=no`, ...), before that parser may refuse anything else in `argv`."""
    probe = _Probe(add_help=False)
    probe.add_argument("--json", type=string_to_bool, nargs="?", const=True, default=False)
    try:
        known, _ = probe.parse_known_args(argv)
    except ValueError:  # a --json value that is no boolean: the parser refuses it, as text
        return False
    return bool(known.json)


def build_parser() -> tuple[argparse.ArgumentParser, _EstimateParser]:
    """The top-level parser and the `estimate` sub-parser."""
    parser = argparse.ArgumentParser(
        prog="accel-gradsync",
        description="Plan gradient sync under FSDP before launch. See docs/estimate.md.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_EstimateParser)
    estimate_parser = commands.add_parser(
        "estimate",
        dataclass_types=[EstimateArguments, GradSyncConfig],
        help="per sync mode: collectives and bytes sent per optimizer step, gradient memory held per rank",
        description="One row per sync mode: reduce-scatters (and HSDP all-reduces) per optimizer step, bytes "
        "each rank sends per step, gradient bytes held per rank between micro-batches and their dtype, the peak "
        "gradient bytes in the first deferred backward, and whether that fits --grad-sync-free-memory. The "
        "model is built on the meta device and sharded as accelerate shards it, in a fake process group inside this "
        "process: nothing is allocated and no other process is started.",
    )
    assert isinstance(estimate_parser, _EstimateParser)  # the subparsers' parser_class
    return parser, estimate_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `accel-gradsync ARGV`: 0 after printing the estimate; argparse's exit 2 with a usage line
    and one error line for a bad flag or any input the estimate refuses (its `ValueError`), and
    under --json that error as `{"error": ...}` on stdout."""
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    parser, estimate_parser = build_parser()
    estimate_parser.json_errors = _asks_for_json(argv[1:])
    # --help, a missing or unknown command, bad flags: argparse's own messages.
    _, unknown = parser.parse_known_args(argv)
    if unknown:  # the estimate's error line (and JSON), not the top-level parser's
        estimate_parser.error(f"unrecognized arguments: {' '.join(unknown)} (--help lists the flags)")
    with warnings.catch_warnings():
        # Every row uses every setting, so "ignored in sync mode X" does not apply here.
        warnings.simplefilter("ignore", GradSyncWarning)
        try:
            args, config = estimate_parser.parse_args_into_dataclasses(argv[1:], look_for_args_file=False)
            check_micro_batches(args.micro_batches)
            if args.num_processes is not None:
                check_processes("--num_processes", args.num_processes)
            shape = read_step_shape(
                args.micro_batch_size,
                args.seq_len,
                args.optimizer,
                args.gradient_checkpointing,
                args.max_completion_length,
                args.num_generations,
            )
            lora = read_lora(args.lora_r, args.lora_target_modules)
            # Only now, with every flag read: the estimate's imports take seconds.
            from accel_gradsync.estimator.core import estimate

            result = estimate(
                args.model,
                args.accelerate_config,
                args.micro_batches,
                config,
                args.num_processes,
                model_dtype=DTYPES[args.model_dtype],
                mixed_precision=args.mixed_precision,
                distributed_config=args.distributed_config,
                step_shape=shape,
                lora=lora,
                beta=args.beta,
                torch_release=args.torch,
                use_vllm=args.use_vllm,
            )
        except ValueError as err:
            estimate_parser.error(str(err))  # exits 2 with the usage line
    from accel_gradsync.estimator.formatting import format_json, format_table

    print(format_json(result) if args.json else format_table(result))
    return 0


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--flag -1GiB` as `--flag=-1GiB`. argparse passes only plain numbers such as -1 as values
    and takes -1GiB for an unknown option, so the user would read "expected one argument"
    instead of what is wrong with the value."""
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and re.match(r"-\.?\d", arg):
            joined[-1] += "=" + arg
        else:
            joined.append(arg)
    return joined
