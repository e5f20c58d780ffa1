r"""Chaos run: the recipe under its self-restarting launch, with faults at random points, must end
exactly where a run nobody interrupted ends.

    python tools/chaos.py --faults 24 --seed 0

For each configuration (FSDP2 windowed, FSDP2 deferred, FSDP1 deferred) it trains the built-in
model once undisturbed, then again with its share of the faults, drawn from --seed: SIGKILL of
one rank, or the preemption signal to the launcher (SIGTERM; SIGUSR1 for FSDP1, forwarded by the
agent through PET_SIGNALS_TO_HANDLE as recipes/slurm_multi_node.sh does), inside generation,
mid-forward or mid-backward in a window, at an optimizer step, while a checkpoint is written, or
right after a restart. A kill is survived by the launch's own restart (`--max_restarts` as many as
it has kills); a preempted launch exits (code 75) and is launched again with the same command, as
a scheduler requeues it. Every run must end with the last checkpoint's weights, optimizer,
scheduler and RNG states equal, tensor bytes for tensor bytes, to the undisturbed run's, with no
restart that no fault caused. Prints faults injected, survived, and optimizer steps recomputed in
total; exits 1 if one was not survived or did not fire.

The faults come from outside the recipe (tools/chaos_faults/sitecustomize.py, on PYTHONPATH).
On 2 CPU cores a fault costs about a minute (a restart reloads everything); 24 faults took 29
minutes. The result of that run is in docs/recipe.md (Preemption, The chaos run).

Tooling that tests the recipe from outside, beside tools/mutants.py; recipes/ holds what a user
runs. The pieces that decide a verdict (the plan, the checkpoint comparison) are checked fast in
tests/tools/test_chaos.py; tests/distributed/test_recipe_chaos.py runs it for real (--slow).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).resolve().parent / "chaos_faults"
PREEMPTED = 75  # accel_gradsync.PREEMPTED_EXIT_CODE (not imported: the script runs without the package set up)
CONFIGS = {
    "fsdp2-windowed": ("fsdp2.yaml", ["--defer-grad-sync", "--grad-sync-keep-params-unsharded"], "SIGTERM"),
    "fsdp2-deferred": ("fsdp2.yaml", ["--defer-grad-sync"], "SIGTERM"),
    "fsdp1-deferred": ("fsdp1.yaml", ["--defer-grad-sync"], "SIGUSR1"),
}
# Where a fault can strike, and the largest n (the n-th such event of the attempt) drawn for it:
# all within about the first two optimizer steps of an attempt (4 micro-batches of one generation
# of 8 tokens each, 2 decoder layers), so that a fault fires before the run can end.
WHERE = {"generation": 8, "forward": 6, "backward": 12, "optimizer": 2, "save": 2, "restart": 1}
STEPS, SAVE_STEPS = 10, 2
RECIPE_ARGS = (
    f"--max_steps {STEPS} --save_steps {SAVE_STEPS} --resume_from_checkpoint auto "
    "--logging_steps 1 --disable_tqdm true --sft_warmup_steps 20"
).split()
# What a checkpoint holds beside the training state compared: the run's settings (its own paths),
# the Trainer's log (times), the completion mark, the tokenizer and model config.
NOT_COMPARED = {"training_args.bin", "trainer_state.json", "checkpoint_complete.json"}


def draw_faults(rng: random.Random, count: int, preempt_signal: str) -> list[dict]:
    """`count` faults, one per attempt in order; the first attempt has no restart to strike after."""
    faults = []
    for i in range(count):
        where = rng.choice([w for w in WHERE if i > 0 or w != "restart"])
        rank = rng.randrange(2)
        n = rng.randint(1, WHERE[where] if where != "save" or rank == 0 else 1)  # rank 1 saves one file itself
        action = rng.choice(["kill", "preempt"])
        faults.append({"id": i, "rank": rank, "where": where, "n": n, "action": action, "signal": preempt_signal})
    return faults


def plan_attempts(faults: list[dict]) -> tuple[dict[str, dict], list[int]]:
    """`<launch>-<restart>` -> the fault of that attempt, and each launch's `--max_restarts`: a kill
    is restarted by the launch itself, a preemption ends the launch (the next one is launched)."""
    plan, restarts, launch, restart = {}, [0], 0, 0
    for fault in faults:
        plan[f"{launch}-{restart}"] = fault
        if fault["action"] == "kill":
            restart += 1
            restarts[launch] += 1
        else:
            launch, restart = launch + 1, 0
            restarts.append(0)
    return plan, restarts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, out_dir: Path, restarts: int, env: dict, log: Path) -> int:
    """One `accelerate launch` of the recipe, as README documents a restarting run; its exit code."""
    accelerate_config, flags, _ = CONFIGS[config]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--main_process_port",
        str(free_port()),
        "--max_restarts",
        str(restarts),
        "--rdzv_backend",
        "c10d",
        "--config_file",
        str(REPO / "accelerate_configs" / accelerate_config),
        str(REPO / "recipes" / "grpo.py"),
        *RECIPE_ARGS,
        *flags,
        "--output_dir",
        str(out_dir),
    ]
    full_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "HF_HUB_OFFLINE": "1", **env}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    paths = [env.get("PYTHONPATH"), str(REPO), os.environ.get("PYTHONPATH")]
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, cwd=REPO, env=full_env, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode


def signal_env(config: str) -> dict:
    """SIGUSR1 as the preemption signal needs the agent to forward it (it dies of it otherwise)."""
    if CONFIGS[config][2] == "SIGUSR1":
        return {
            "ACCEL_GRADSYNC_SAVE_ON_SIGNAL": "SIGUSR1",
            "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        }
    return {}


def run_config(config: str, faults: list[dict], work: Path) -> dict:
    """The undisturbed run and the faulted one of `config`; what happened to each fault."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    reference = work / "reference"
    if launch(config, reference, 0, signal_env(config), log) != 0:
        raise RuntimeError(f"{config}: the undisturbed run failed; see {log}")
    plan, restarts = plan_attempts(faults)
    plan_file = work / "plan.json"
    plan_file.write_text(json.dumps(plan))
    out_dir = work / "faulted"
    env = {**signal_env(config), "CHAOS_PLAN": str(plan_file), "PYTHONPATH": str(FAULTS)}
    codes: list[int] = []
    # A preempted launch is launched again, as a scheduler requeues it; any other ending ends the run.
    while not codes or codes[-1] != 0 and fired_preemption(work, len(codes) - 1):
        index = len(codes)
        max_restarts = restarts[index] if index < len(restarts) else 0
        codes.append(launch(config, out_dir, max_restarts, {**env, "CHAOS_LAUNCH": str(index)}, log))
    fired = [json.loads(p.read_text()) for p in sorted((work / "fired").glob("*.json"), key=lambda p: int(p.stem))]
    differences = compare_checkpoints(reference / f"checkpoint-{STEPS}", out_dir / f"checkpoint-{STEPS}")
    differences += unplanned_restarts(work, fired)
    survived = codes[-1] == 0 and not differences
    recomputed = sum(steps_recomputed(work, fault, plan) for fault in fired)
    return {
        "config": config,
        "fired": fired,
        "planned": len(faults),
        "exit_codes": codes,
        "differences": differences[:5],
        "survived": survived,
        "recomputed": recomputed,
    }


def unplanned_restarts(work: Path, fired: list[dict]) -> list[str]:
    """Attempts that no kill of this run caused: a rank failed by itself, and the launch's restart
    hid it."""
    killed = {fault["attempt"] for fault in fired if fault["action"] == "kill"}
    unplanned = []
    for path in (work / "attempts").glob("*.json"):
        launch_index, restart = map(int, path.stem.split("-"))
        if restart > 0 and f"{launch_index}-{restart - 1}" not in killed:
            unplanned.append(f"restart {path.stem} without a kill (see log.txt)")
    return sorted(unplanned)


def fired_preemption(work: Path, launch_index: int) -> bool:
    """A preemption fired in that launch: its non-zero exit is the expected one."""
    for path in (work / "fired").glob("*.json"):
        fault = json.loads(path.read_text())
        if fault["action"] == "preempt" and fault["attempt"].split("-")[0] == str(launch_index):
            return True
    return False


def steps_recomputed(work: Path, fault: dict, plan: dict) -> int:
    """Optimizer steps the fault's attempt had finished that the next attempt trains again."""
    launch_index, restart = map(int, fault["attempt"].split("-"))
    following = f"{launch_index}-{restart + 1}" if fault["action"] == "kill" else f"{launch_index + 1}-0"
    start = json.loads((work / "attempts" / f"{fault['attempt']}.json").read_text())["start"]
    next_file = work / "attempts" / f"{following}.json"
    if not next_file.exists():
        return 0
    return max(0, start + fault["steps_done"] - json.loads(next_file.read_text())["start"])


def compare_checkpoints(a: Path, b: Path) -> list[str]:
    """What differs between two checkpoint folders' training state (weights, optimizer, scheduler,
    RNG): tensor bytes and every other value, file by file; a missing folder is one difference."""
    if not a.is_dir() or not b.is_dir():
        return [f"missing: {a if not a.is_dir() else b}"]
    left, right = checkpoint_state(a), checkpoint_state(b)
    if not left:
        return [f"nothing compared in {a}"]
    return sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))


def checkpoint_state(folder: Path) -> dict[str, bytes]:
    """Every tensor and value of the folder's training state, by file and key: safetensors and
    torch.save files as they load, torch.distributed.checkpoint folders (FSDP1's sharded state
    dict) converted to one torch.save file first."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state: dict[str, bytes] = {}
    for path in sorted(folder.iterdir()):
        if path.name in NOT_COMPARED:
            continue
        if path.is_dir() and (path / ".metadata").exists():
            with tempfile.TemporaryDirectory() as tmp:
                dcp_to_torch_save(path, Path(tmp) / "state.pt")
                _flatten(torch.load(Path(tmp) / "state.pt", weights_only=False), path.name, state)
        elif path.suffix == ".safetensors":
            _flatten(load_file(path), path.name, state)
        elif path.suffix in (".bin", ".pt", ".pth"):
            _flatten(torch.load(path, weights_only=False), path.name, state)
    return state


def _flatten(value, key: str, into: dict[str, bytes]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{key}/{k}", into)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{key}[{i}]", into)
    elif torch.is_tensor(value):
        into[key] = (
            f"{value.dtype}{tuple(value.shape)}".encode()
            + value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
    elif hasattr(value, "tobytes"):  # numpy arrays (the RNG states)
        into[key] = repr((value.dtype, value.shape)).encode() + value.tobytes()
    else:
        into[key] = repr(value).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=24, help="faults in all, shared out across the configurations")
    parser.add_argument("--seed", type=int, default=0, help="draws where, when, which rank and kill or preempt")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--work_dir", default=None, help="where runs are written (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints)")
    args = parser.parse_args(argv)
    if args.faults < 1:
        parser.error(f"--faults {args.faults}: must be >= 1")
    rng = random.Random(args.seed)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    share = math.ceil(args.faults / len(args.configs))
    results, left, began = [], args.faults, time.monotonic()
    for config in args.configs:
        faults = draw_faults(rng, min(share, left), CONFIGS[config][2])
        left -= len(faults)
        result = run_config(config, faults, work / config)
        results.append(result)
        for fault in result["fired"]:
            sent = fault["signal"] if fault["action"] == "preempt" else "SIGKILL"
            print(
                f"{config}: fault {fault['id']}: {fault['action']} ({sent}) rank {fault['rank']} at "
                f"{fault['where']} #{fault['n']}, attempt {fault['attempt']}",
                flush=True,
            )
        print(
            f"{config}: {len(result['fired'])} of {result['planned']} faults fired, exit codes {result['exit_codes']}, "
            f"{'survived' if result['survived'] else 'NOT survived: ' + ', '.join(result['differences'])}, "
            f"{result['recomputed']} steps recomputed",
            flush=True,
        )
    injected = sum(len(r["fired"]) for r in results)
    survived = sum(len(r["fired"]) for r in results if r["survived"])
    recomputed = sum(r["recomputed"] for r in results)
    print(
        f"faults injected: {injected}, survived: {survived}, steps recomputed: {recomputed} "
        f"(seed {args.seed}, {time.monotonic() - began:.0f} s)"
    )
    (work / "summary.json").write_text(json.dumps(results, indent=1))
    if not args.keep and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    planned = sum(r["planned"] for r in results)
    if injected < planned:  # a fault that never struck tells nothing: the figure counts only those that did
        print(f"{planned - injected} of {planned} planned faults did not fire (the run ended first)")
    return 0 if survived == injected == planned and all(r["survived"] for r in results) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
