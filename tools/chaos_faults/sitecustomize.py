"""The faults `tools/chaos.py` injects into a launched recipe, from outside it: put on PYTHONPATH
with CHAOS_PLAN (a JSON file) and CHAOS_LAUNCH (the launch's index), every rank loads this first.

The plan maps `<launch>-<restart>` (CHAOS_LAUNCH, TORCHELASTIC_RESTART_COUNT) to at most one fault:
`{"id", "rank", "where", "n", "action", "signal"}`. On that attempt the rank counts the events of
`where` and, at the n-th, writes `fired/<id>.json` beside the plan (the optimizer steps it finished
in this attempt) and then acts: `kill` is SIGKILL to itself, `preempt` sends `signal` to its
launcher (torch elastic's agent, its parent), as a scheduler does before it kills. `where`:

- `generation`: a forward inside `generate()` (wrapped here, to tell generation apart);
- `forward`: a forward of the model with gradients (micro-batch n of the attempt);
- `backward`: a decoder layer's output gradient (backward between two layers);
- `optimizer`: the start of optimizer step n (torch's global optimizer step pre-hook);
- `save`: the n-th `torch.save` into a `checkpoint-` folder (a kill leaves the file cut short);
- `restart`: the attempt's first forward in generation (the plan only puts it after a restart).

Events count from the attempt's first generation on: the built-in model's warm-up trains before.

Every attempt, faulted or not, writes `attempts/<launch>-<restart>.json` with the step it starts
from (the newest complete checkpoint of --output_dir), so the script counts recomputed steps.
"""

import json
import os
import sys

if os.environ.get("CHAOS_PLAN") and "--output_dir" in sys.argv:
    import signal
    from pathlib import Path

    _plan_file = Path(os.environ["CHAOS_PLAN"])
    _attempt = f"{os.environ.get('CHAOS_LAUNCH', '0')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _rank = os.environ.get("RANK", "0")
    _fault = json.loads(_plan_file.read_text()).get(_attempt)
    _steps = [0]  # optimizer steps this attempt finished

    def _start_step() -> int:
        from accel_gradsync.runtime.faults.resume import newest_complete_checkpoint

        folder = newest_complete_checkpoint(sys.argv[sys.argv.index("--output_dir") + 1])
        return int(folder.rsplit("-", 1)[1]) if folder else 0

    if _rank == "0":
        _record = _plan_file.parent / "attempts" / f"{_attempt}.json"
        _record.parent.mkdir(exist_ok=True)
        _record.write_text(json.dumps({"start": _start_step()}))

    import torch
    import transformers
    from torch.optim.optimizer import register_optimizer_step_post_hook

    # The recipe's supervised warm-up of its built-in model trains before GRPO: events count from
    # the first generation on, which only the Trainer does.
    _started = [False]
    _generating = [False]
    _generate = transformers.GenerationMixin.generate

    def generate(self, *args, **kwargs):
        _started[0] = _generating[0] = True
        try:
            return _generate(self, *args, **kwargs)
        finally:
            _generating[0] = False

    transformers.GenerationMixin.generate = generate
    register_optimizer_step_post_hook(lambda *args: _steps.__setitem__(0, _steps[0] + _started[0]))

    if _fault is not None and str(_fault["rank"]) == _rank:
        _count = [0]
        _done = [False]

        def _event() -> None:
            """One event of the fault's kind: at the n-th, record it and act."""
            if _done[0] or not _started[0]:
                return
            _count[0] += 1
            if _count[0] < _fault["n"]:
                return
            _done[0] = True
            fired = _plan_file.parent / "fired" / f"{_fault['id']}.json"
            fired.parent.mkdir(exist_ok=True)
            fired.write_text(json.dumps({**_fault, "attempt": _attempt, "steps_done": _steps[0]}))
            if _fault["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                os.kill(os.getppid(), signal.Signals[_fault["signal"]])

        where = _fault["where"]
        if where in ("generation", "forward", "restart"):

            def _pre_forward(module, args):
                if not type(module).__name__.endswith("ForCausalLM"):
                    return
                if where == "forward" and torch.is_grad_enabled() or where != "forward" and _generating[0]:
                    _event()

            torch.nn.modules.module.register_module_forward_pre_hook(_pre_forward)
        elif where == "backward":

            def _post_forward(module, args, output):
                out = output[0] if isinstance(output, tuple) else output
                if type(module).__name__.endswith("DecoderLayer") and torch.is_tensor(out) and out.requires_grad:
                    out.register_hook(lambda grad: _event())

            torch.nn.modules.module.register_module_forward_hook(_post_forward)
        elif where == "optimizer":
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(lambda *args: _event())
        elif where == "save":
            _save = torch.save

            def save(obj, f, *args, **kwargs):
                if isinstance(f, (str, os.PathLike)) and "checkpoint-" in os.fspath(f):
                    if _fault["action"] == "kill" and _count[0] + 1 == _fault["n"]:
                        with open(f, "wb") as partial:  # what a write cut short leaves
                            partial.write(b"PK\x03\x04")
                    _event()
                return _save(obj, f, *args, **kwargs)

            torch.save = save
        else:
            raise ValueError(f"CHAOS_PLAN: unknown fault place {where!r}")
