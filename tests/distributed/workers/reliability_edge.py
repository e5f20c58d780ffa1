"""Run a list of schedules (see schedules.py) one after the other on the launched ranks, each
with a fresh model, and report each one's result. `--specs` is a JSON file; `--checkpoint`
also runs the save_state/load_state scenario of reliability_checkpoint.py per sync mode."""

import json
import os
from pathlib import Path

from accelerate import Accelerator
from common import CollectiveCounter, parse_args, write_result
from schedules import run_schedule

import accel_gradsync

args = parse_args([(("--specs",), {"required": True}), (("--checkpoint",), {"default": ""})])
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()
accelerator = Accelerator(gradient_accumulation_steps=1)
specs = json.loads(Path(args.specs).read_text())
result = {"runs": {spec["name"]: run_schedule(accelerator, spec, counter) for spec in specs}, "checkpoint": {}}
if args.checkpoint:  # JSON {name: GradSyncConfig kwargs}: save/load_state mid-run in each
    from reliability_checkpoint import run_checkpoint

    for name, config in json.loads(args.checkpoint).items():
        result["checkpoint"][name] = run_checkpoint(accelerator, config, os.path.join(args.out, "ckpt", name))
write_result(args.out, result)
