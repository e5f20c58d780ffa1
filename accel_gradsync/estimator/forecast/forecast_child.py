"""The step forecast's child process (`python -m accel_gradsync.estimator.forecast.forecast_child SPEC.json`)
and `ForecastChild`, the main process's handle on it.

The forecast runs in a fake process group, which cannot share a process with the run's real one,
so live.py runs it here. One JSON line each way: the child's first line is the forecast of a step
that syncs every micro-batch and holds nothing; then, for each plan written to its stdin (units by
name per level), the step peak of that plan, simulated as the estimate simulates that plan's row
(`StepForecaster.row` in mode `auto`: one source for both numbers). It ends at the end of its stdin.

The child starts with the preemption signals (`HELD_SIGNALS`) blocked: a scheduler signals every
process of a job, and the signal is the run's to act on (runtime/faults/preemption.py saves at the next
step boundary), not a reason to lose the forecast. A blocked mask survives `exec`, so there is no
moment in which the child can be killed by one; SIGKILL (a timeout) still ends it.
"""

from __future__ import annotations

import dataclasses
import json
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from accel_gradsync.config.settings import DTYPES, GradSyncConfig, SyncMode
from accel_gradsync.planning.units import Plan

CHILD_TIMEOUT_S = 1800
"""The longest the main process waits for one answer."""
HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""What a scheduler or a user sends to stop or save a run (`save_on_signal` takes SIGTERM or SIGUSR1)."""


class ForecastFailed(Exception):
    """The child ended, timed out or refused: the message is its one line on why."""


class ForecastChild:
    """The main process's end of one child for `spec` (live.py builds it): started on first use,
    started again after `close()` when asked once more."""

    def __init__(self, spec: dict, environment: dict[str, str]) -> None:
        self.spec, self.environment = spec, environment
        self.process: subprocess.Popen | None = None
        self.stderr: IO[bytes] | None = None
        self.unheld: dict | None = None

    def forecast_unheld(self) -> dict:
        """The child's first answer: the step that syncs every micro-batch (`forecast_unheld_step`)."""
        if self.process is None:
            self._start()
        assert self.unheld is not None  # read by _start
        return self.unheld

    def forecast_plan(self, plan: Plan) -> dict:
        """The simulated step peak of `plan` (`ForecastSession.forecast_plan`)."""
        self.forecast_unheld()
        assert self.process is not None and self.process.stdin is not None
        request = {
            "held": [u.name for u in plan.held],
            "windowed": [u.name for u in plan.windowed],
            "held_sync": plan.held_sync,
            "generation_bytes": plan.generation_bytes,
        }
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise ForecastFailed(answer["error"])
        return answer

    def close(self) -> None:
        """End the child (at the end of its stdin), if it runs."""
        if self.process is not None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None

    def _start(self) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open as long as the child runs: close()
        with tempfile.TemporaryDirectory(prefix="accel_gradsync_forecast_") as folder:
            spec = dict(self.spec)
            spec["model_config"].save_pretrained(folder)
            spec["model_config"] = folder
            spec_path = Path(folder) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            command = [sys.executable, "-m", "accel_gradsync.estimator.forecast.forecast_child", str(spec_path)]
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)  # the child's mask from fork on
            try:
                self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self.stderr,
                    text=True,
                    env=self.environment,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            self.unheld = self._read()  # the spec's files are read by then

    def _read(self) -> dict:
        """The child's next line, or `ForecastFailed` with its last line of stderr."""
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], CHILD_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            self.process.kill()
        code = self.process.wait()
        why = f"no answer in {CHILD_TIMEOUT_S} s" if not ready else f"exit code {code}"
        assert self.stderr is not None
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        self.close()
        raise ForecastFailed(lines[-1] if ready and lines else why)


class ForecastSession:
    """The child's side: the launch, model and shape of `spec` on fake tensors, one `StepForecaster`
    for every answer (it runs each distinct schedule once)."""

    def __init__(self, spec: dict) -> None:
        from accel_gradsync.estimator.fake_shard import KeepFrozen
        from accel_gradsync.estimator.inputs import LoraSpec, StepShape, load_model_config, read_accelerate_config
        from accel_gradsync.estimator.meta_model import build_meta_model, estimated_adapter
        from accel_gradsync.estimator.step_peak import StepForecaster

        model_config = load_model_config(spec["model_config"])
        setup = read_accelerate_config(spec["accelerate_config"])
        config = GradSyncConfig(**spec["settings"])
        dtype, self.shape = DTYPES[spec["model_dtype"]], StepShape(**spec["shape"])
        lora = spec["lora"]
        self.lora = None if lora is None else LoraSpec(lora["r"], tuple(lora["target_modules"] or ()) or None)
        self.forecaster = StepForecaster(
            model_config, dtype, setup, config, self.shape, spec["micro_batches"], self.lora
        )
        model = build_meta_model(model_config, dtype, self.lora)
        kept = frozenset(spec.get("kept", ()))
        # NOTE: the run's prepare decided which frozen units to keep, from memory the child cannot
        # read: split and keep every one as `true` does, then leave kept only the run's.
        keep = (
            KeepFrozen(dataclasses.replace(config.resolved(), keep_frozen_unsharded=True), lambda: 0) if kept else None
        )
        adapter = estimated_adapter(model, setup, config, SyncMode.AUTO, keep=keep)
        adapter.units = [dataclasses.replace(u, resident=u.resident and u.name in kept) for u in adapter.units]
        self.adapter = adapter

    def forecast_unheld(self) -> dict:
        """The forecast of a step syncing every micro-batch, with `auto`'s reduce dtype."""
        peak = self.forecaster.row(Plan(SyncMode.PER_MICRO_BATCH), self.adapter, SyncMode.AUTO)
        shape = self.shape
        setup = ", gradient checkpointing" if shape.gradient_checkpointing else ""
        setup += f", LoRA r={self.lora.r}" if self.lora else ""
        described = (
            f"{shape.micro_batch_size}x{shape.seq_len} tokens per micro-batch, {shape.optimizer}{setup}: "
            f"peak at {peak.phase.replace('_', ' ')}"
        )
        return {"peak_bytes": peak.peak_bytes, "phase": peak.phase, "unmodeled": peak.unmodeled, "shape": described}

    def forecast_plan(self, request: dict) -> dict:
        """The step peak of the plan `request` names (units by name), as the estimate's row for it."""
        units = {u.name: u for u in self.adapter.units}
        missing = [name for name in (*request["held"], *request["windowed"]) if name not in units]
        if missing:
            raise ValueError(f"the run's unit {missing[0]!r} is not among the forecast model's units")
        plan = Plan(
            SyncMode.AUTO,
            held=[units[name] for name in request["held"]],
            held_sync=request["held_sync"],
            windowed=[units[name] for name in request["windowed"]],
            generation_bytes=request["generation_bytes"],
        )
        peak = self.forecaster.row(plan, self.adapter, SyncMode.AUTO)
        return {"peak_bytes": peak.peak_bytes, "phase": peak.phase, "unmodeled": peak.unmodeled}


def forecast_unheld_step(spec: dict) -> dict:
    """The child's first answer for `spec`, computed in this process (the tests' way in)."""
    return ForecastSession(spec).forecast_unheld()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    try:
        session = ForecastSession(spec)
        _answer(session.forecast_unheld())
    except ValueError as error:
        print(" ".join(str(error).split()), file=sys.stderr)
        return 2
    for line in sys.stdin:
        try:
            _answer(session.forecast_plan(json.loads(line)))
        except ValueError as error:
            _answer({"error": " ".join(str(error).split())})
    return 0


def _answer(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
