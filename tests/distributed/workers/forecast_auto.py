"""`auto` with the forecast shape set: a tiny Qwen2 (FSDP2, AdamW) trained for --steps optimizer
steps of M micro-batches per run. Reports, per step, the reduce-scatters counted from outside and
the handle's plan and `auto` counters, and the lines the main process printed. A run may script
the device (`probe`: capacity and each step's peak), to play a step that overshoots the forecast.

A run with `preempt_in_forecast` (and `save_on_signal` in its config) plays a scheduler's
preemption during the forecast: the main process sends SIGTERM to the forecast's child the moment
it has one, then to itself, as a scheduler signals every process of a job. Each rank then asks
`handle.preempted()` after every micro-batch and, when told, writes what it has (the results of
the runs before, and this run's step), saves and exits with `PREEMPTED_EXIT_CODE`. The run goes
last: nothing after it runs."""

import contextlib
import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import CollectiveCounter, parse_args, tiny_qwen2_config, write_result
from transformers import AutoModelForCausalLM

import accel_gradsync
from accel_gradsync.planning.memory import ScriptedMemoryProbe

args = parse_args(
    [
        (("--runs",), {"type": json.loads, "required": True}),  # [{"name", "config", "probe"?}]
        (("--M",), {"type": int, "default": 4}),
        (("--steps",), {"type": int, "default": 3}),
        (("--mbs",), {"type": int, "default": 2}),
        (("--seq",), {"type": int, "default": 16}),
    ]
)
accel_gradsync.enable_cpu_fsdp()
counter = CollectiveCounter()


def signal_the_forecast(seen: dict) -> None:
    """In a thread: SIGTERM to this process's first child the moment there is one (the forecast's,
    started at bind), then to this process. `seen["child_running"]`: the child was running when
    signalled (not yet ended), so the signal came during the forecast."""
    me, child = os.getpid(), None
    while child is None:
        pids = []
        for task in Path(f"/proc/{me}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                pids += [int(pid) for pid in (task / "children").read_text().split()]
        child = pids[0] if pids else None
        time.sleep(0.002)
    try:
        seen["child_running"] = Path(f"/proc/{child}/stat").read_text().rpartition(") ")[2][0] not in "ZXx"
        os.kill(child, signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        seen["child_running"] = False
    os.kill(me, signal.SIGTERM)


accelerator = Accelerator(gradient_accumulation_steps=args.M)
results = {}
for run in args.runs:
    set_seed(0)
    probe = None
    if "probe" in run:
        probe = ScriptedMemoryProbe(run["probe"]["capacity"], run["probe"]["peaks"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        config = accel_gradsync.GradSyncConfig(**run["config"])
        handle = accel_gradsync.attach(accelerator, config, memory_probe=probe)
        model_config = tiny_qwen2_config()
        model = AutoModelForCausalLM.from_config(model_config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seen: dict = {}
        if run.get("preempt_in_forecast") and accelerator.is_main_process:
            threading.Thread(target=signal_the_forecast, args=(seen,), daemon=True).start()
        model, optimizer = accelerator.prepare(model, optimizer)
        first_plan = handle.plan()
        steps = []
        for step in range(args.steps):
            counter.take()
            for k in range(args.M):
                g = torch.Generator().manual_seed(1000 * step + 10 * k + accelerator.process_index)
                ids = torch.randint(0, model_config.vocab_size, (args.mbs, args.seq), generator=g)
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
                    optimizer.step()
                    optimizer.zero_grad()
                if run.get("preempt_in_forecast") and handle.preempted():
                    results[run["name"]] = {"preempted_at_step": step + 1, "micro_batch": k, **seen}
                    results[run["name"]]["forecast_peak_bytes"] = handle.stats().get("forecast_peak_bytes")
                    results[run["name"]]["printed"] = printed.getvalue()
                    # The results so far, without write_result's leaving the group: the save needs it.
                    mine = Path(args.out, f"rank{accelerator.process_index}.json")
                    mine.write_text(json.dumps({"runs": results}, default=str))
                    checkpoint = str(Path(args.out, "checkpoint"))
                    accelerator.save_state(checkpoint)
                    handle.exit_preempted(checkpoint)
            counts = counter.take()
            stats = handle.stats()
            steps.append(
                {
                    "reduce_scatters": counts.get("reduce_scatter_tensor", 0) + counts.get("reduce_scatter_single", 0),
                    "held": len(handle.plan().held),
                    "plan_changes": stats["plan_changes"],
                    "forecast_peak_bytes": stats.get("forecast_peak_bytes"),
                    "measured_peak_bytes": stats.get("measured_peak_bytes"),
                }
            )
        results[run["name"]] = {
            "units": stats["units"],
            "first_plan_held": len(first_plan.held),
            "steps": steps,
        }
        handle.detach()
    results[run["name"]]["printed"] = printed.getvalue()
    del model, optimizer
    accelerator.free_memory()

write_result(args.out, {"runs": results})
