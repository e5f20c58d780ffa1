"""Mutation check: each mutant below breaks the package on purpose, and the tests named with it
must catch the break (at least one of them fails). Run it before a release (`make mutants`):

    python tools/mutants.py                 # every mutant
    python tools/mutants.py NAME [NAME...]  # some of them; --list names them all

Each mutant runs in its own copy of the repository (the files git tracks or would track, as they
are in the working tree), with one exact text replaced by another, and the named tests run there
with this interpreter, `PYTHONPATH=<copy>`: the copy's package is imported, not the editable
install's (its finder comes after PYTHONPATH on sys.meta_path), by pytest and by every rank a
test launches, which inherits the environment. The tool checks the first for every copy; the
`canary_launched_ranks_import_the_copy` mutant checks the second.

Exit 1 when a mutant is missed, when its text no longer occurs exactly once in its file (the
code moved: update the mutant), or when its tests could not run. A new mutant is an entry in
MUTANTS: the files it edits, the exact text and its replacement, and the tests (pytest node ids
or paths) that must catch it. tests/repo/test_mutants.py keeps the texts matching the code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> {"what": the break, "edits": [(file, exact old text, new text)], "tests": [...]}
MUTANTS: dict[str, dict] = {
    "uneven_steps_evened_uncounted": {
        "what": "grad_sync.step(n) never counts the micro-batches windowing makes free",
        "edits": [
            (
                "accel_gradsync/runtime/core/accounting.py",
                "counts.evened_micro_batches += evened",
                "counts.evened_micro_batches += 0",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_steps.py::test_fsdp2_every_mode_ends_at_the_padded_run_with_per_rank_counts"
        ],
    },
    "uneven_steps_last_micro_batch_gathers_per_token": {
        "what": "with every unit windowed, step(n)'s last micro-batch reshards after each forward: a generation there "
        "gathers per token while a longer count's held micro-batch gathers once",
        "edits": [
            (
                "accel_gradsync/runtime/integration/hooks.py",
                "if steps.keeps_windowed():",
                "if False:",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_steps.py::"
            "test_a_generation_before_the_first_micro_batch_or_with_every_unit_windowed_runs_with_per_rank_counts"
        ],
    },
    "kept_frozen_units_never_gated": {
        "what": "FSDP2's per-forward work runs at every generated token on keep_frozen_unsharded's units",
        "edits": [
            (
                "accel_gradsync/runtime/generating/generation.py",
                "skip_idle_forward_work(adapter, [u for u in adapter.units if u.resident])",
                "skip_idle_forward_work(adapter, [])",
            )
        ],
        "tests": [
            "tests/distributed/test_frozen_units.py::"
            "test_generation_skips_fsdp2s_forward_work_on_the_kept_units_in_every_mode"
        ],
    },
    "kept_frozen_units_never_resharded": {
        "what": "grad_sync.reshard_frozen() leaves keep_frozen_unsharded's units unsharded",
        "edits": [
            (
                "accel_gradsync/runtime/wrappers/frozen_units.py",
                "for module, _ in self._kept.values():\n            module.reshard()",
                "for module, _ in self._kept.values():\n            pass",
            )
        ],
        "tests": [
            "tests/distributed/test_frozen_units.py::"
            "test_merging_the_adapter_after_reshard_frozen_reads_what_stock_reads_and_regathers"
        ],
    },
    "deferred_plan_holds_nothing": {
        "what": "DeferredSync.plan holds nothing: deferred behaves as per-micro-batch",
        "edits": [
            (
                "accel_gradsync/planning/policies.py",
                "return Plan(self.name, held, windowed=held if windows else [], generation_bytes=generation)",
                "return Plan(self.name, [], windowed=[], generation_bytes=generation)",
            )
        ],
        "tests": ["tests/distributed/test_properties.py"],
    },
    "all_gathers_ignore_kept_through_forward": {
        "what": "micro_batch_all_gathers ignores kept_through_forward (a window's backward gathers again)",
        "edits": [
            (
                "accel_gradsync/planning/costs.py",
                "(1 if unit.reshards_after_forward and not kept_through_forward else 0)",
                "(1 if unit.reshards_after_forward else 0)",
            )
        ],
        "tests": ["tests/unit/planning/test_costs.py"],
    },
    "generation_per_token_plus_one": {
        "what": "generation_cost counts one all-gather too many per generated token",
        "edits": [
            (
                "accel_gradsync/planning/costs.py",
                "    per_token = generation_all_gathers_per(units, kept=False)\n",
                "    per_token = generation_all_gathers_per(units, kept=False) + 1\n",
            )
        ],
        "tests": [
            "tests/unit/planning/test_units_frozen.py::test_the_estimate_and_the_decision_line_read_one_generation_cost"
        ],
    },
    "bytes_reduced_and_all_reduces_skipped_zero": {
        "what": "the counters bytes_reduced and all_reduces_skipped always read 0",
        "edits": [
            (
                "accel_gradsync/runtime/core/accounting.py",
                "if f.name not in _LEVELS)",
                'if f.name not in (*_LEVELS, "bytes_reduced", "all_reduces_skipped"))',
            ),
            (
                "accel_gradsync/runtime/core/accounting.py",
                "counts.bytes_reduced += grad_bytes",
                "counts.bytes_reduced += 0",
            ),
        ],
        "tests": ["tests/unit", "tests/repo", "tests/distributed/test_accumulate.py"],
    },
    "deferred_syncs_every_micro_batch": {
        "what": "a held FSDP2 unit keeps requires_gradient_sync True: deferred reduce-scatters every micro-batch",
        "edits": [
            (
                "accel_gradsync/runtime/wrappers/fsdp2.py",
                "_fsdp2(u.module).set_requires_gradient_sync(False, recurse=False)",
                "_fsdp2(u.module).set_requires_gradient_sync(True, recurse=False)",
            )
        ],
        "tests": ["tests/distributed/test_accumulate.py", "tests/distributed/test_window.py"],
    },
    "window_reshards_after_backward": {
        "what": "a windowed FSDP2 unit reshards after every backward (gathers again in the next forward)",
        "edits": [
            (
                "accel_gradsync/runtime/wrappers/fsdp2.py",
                "_fsdp2(u.module).set_reshard_after_backward(False, recurse=False)",
                "_fsdp2(u.module).set_reshard_after_backward(True, recurse=False)",
            )
        ],
        "tests": ["tests/distributed/test_accumulate.py", "tests/distributed/test_window.py"],
    },
    "catch_up_skips_replays": {
        "what": "a rank done first skips the forwards it is short after a generation without the sync",
        "edits": [
            (
                "accel_gradsync/runtime/generating/draw_replay.py",
                "    missing = int(most.item()) - seen.forwards",
                "    missing = 0",
            )
        ],
        "tests": [
            "tests/distributed/test_draw_replay.py",
            "tests/distributed/test_uneven_generation.py::"
            "test_lora_dropout_runs_unsynced_and_the_rank_done_first_draws_what_it_draws_under_the_sync",
        ],
    },
    "last_forward_reshards": {
        "what": "the window's last micro-batch reshards its windowed params after forward (its backward gathers again)",
        "edits": [
            (
                "accel_gradsync/runtime/accumulation/kept_forward.py",
                "        if bound.plan.windowed:\n            self.put_back(root)",
                "        if False:\n            self.put_back(root)",
            )
        ],
        "tests": [
            "tests/distributed/test_window.py::test_windowed_gathers_each_unit_once_per_step_and_matches_the_reference"
        ],
    },
    "stale_after_the_step": {
        "what": "a unit a forward after the last backward left unsharded stays so through the optimizer step",
        "edits": [
            (
                "accel_gradsync/runtime/accumulation/window.py",
                "bound.adapter.reshard_left_gathered(optimizer)",
                "pass",
            )
        ],
        "tests": [
            "tests/distributed/test_reliability_edge.py::test_a_forward_without_backward_before_the_step_leaves_nothing_stale"
        ],
    },
    "metric_before_the_replays": {
        "what": "step(n): a forward without gradients after the last backward runs before the replays",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/uneven_steps.py",
                "self._last.before_forward_without_grad()",
                "pass",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_steps.py::test_fsdp2_a_metric_forward_after_the_last_backward_sees_the_stepped_params"
        ],
    },
    "stale_inside_step_n": {
        "what": "step(n): a unit a metric forward left unsharded stays so through the optimizer step",
        "edits": [
            (
                "accel_gradsync/runtime/accumulation/window.py",
                "if bound.hold is None and not keep:",
                "if bound.hold is None and not keep and not self.state.step_largest:",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_steps.py::test_fsdp2_a_metric_forward_after_the_last_backward_sees_the_stepped_params"
        ],
    },
    "replay_a_trailing_forward": {
        "what": "step(n): a forward with gradients and no backward after the last one is replayed, not refused",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/step_replay.py",
                "if iteration.forwards_after_last_backward():",
                "if False:",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_steps.py::"
            "test_a_forward_with_gradients_and_no_backward_after_the_last_is_refused_where_a_rank_replays"
        ],
    },
    "join_metric_replayed": {
        "what": "join(): a forward without gradients after the backward is recorded with the micro-batch",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/join.py",
                "if not torch.is_grad_enabled() and self._current.backed() and root in self.state.bound:",
                "if False:",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_inputs.py::"
            "test_fsdp2_a_metric_forward_after_the_backward_is_forwarded_by_a_rank_that_left_too"
        ],
    },
    "join_shadow_clips_a_kept_list": {
        "what": "join(): a rank that left clips the parameter list kept from its last clip, not the model's now",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/join.py",
                "if self._clip_model is not None:",
                "if False:",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_inputs.py::test_fsdp2_join_follows_every_scheduler_loop_style_and_logged_collective"
        ],
    },
    "stale_reshard_for_any_optimizer": {
        "what": "any optimizer's step reshards what a bound model keeps for its backward (a GAN's other one too)",
        "edits": [
            (
                "accel_gradsync/runtime/wrappers/fsdp2.py",
                "return []  # another model's optimizer (a GAN's): these are not stale",
                "pass",
            )
        ],
        "tests": [
            "tests/distributed/test_reliability_edge.py::"
            "test_another_models_optimizer_step_inside_a_micro_batch_reshards_nothing"
        ],
    },
    "budget_takes_units_that_do_not_fit": {
        "what": "budget's first fit takes a level while the bytes used so far fit, whatever it adds",
        "edits": [
            (
                "accel_gradsync/planning/policies.py",
                "== needs and used + cost <= budget:",
                "== needs and used <= budget:",
            )
        ],
        "tests": [
            "tests/unit/planning/test_policies_levels.py",
            "tests/unit/planning/test_units_frozen.py",
            "tests/unit/config/test_budget_selection.py",
        ],
    },
    "frozen_unit_counted_as_trained": {
        "what": "a unit without trainable parameters (a frozen model's) is counted as trained",
        "edits": [
            (
                "accel_gradsync/planning/units.py",
                "        return self.numel == 0\n",
                "        return False\n",
            )
        ],
        "tests": ["tests/unit/planning/test_units_frozen.py", "tests/distributed/test_two_models.py"],
    },
    "decision_line_reduce_scatters_off_by_one": {
        "what": "the decision line says one reduce-scatter per step more than the plan makes",
        "edits": [
            (
                "accel_gradsync/runtime/core/decision.py",
                'cost = f"{rs} reduce-scatters and {ag} all-gathers/step',
                'cost = f"{rs + 1} reduce-scatters and {ag} all-gathers/step',
            )
        ],
        "tests": [
            "tests/unit/planning/test_units_frozen.py",
            "tests/unit/runtime/core/test_decision.py",
            "tests/unit/estimator/test_core.py",
        ],
    },
    "recipe_reference_without_a_model_path": {
        "what": "the recipe gives TRL its built-in model with an empty name_or_path: --beta cannot build the "
        "reference model",
        "edits": [("recipes/grpo.py", "model = embedded.reload_from(model, folder)", "pass")],
        "tests": ["tests/distributed/test_grpo_recipe.py::test_the_default_model_trains_with_a_reference_model"],
    },
    "join_shadow_keeps_its_own_learning_rate": {
        "what": "a rank that left join() steps with its own hyperparameters, not the training ranks'",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/join_steps.py",
                "                _write(group, values[at : at + n])\n",
                "                pass\n",
            )
        ],
        "tests": [
            "tests/distributed/test_uneven_inputs.py::test_fsdp2_join_follows_every_scheduler_loop_style_and_logged_collective"
        ],
    },
    "token_sync_off_without_proof": {
        "what": "generate skips transformers' per-token sync without the proof that forwards issue no collective",
        "edits": [
            (
                "accel_gradsync/runtime/generating/token_sync.py",
                "            if not proof.settled(module.training):\n",
                "            if False:\n",
            ),
            (
                "accel_gradsync/runtime/generating/token_sync.py",
                "            if proof.free(module.training):\n",
                "            if not proof.collectives:\n",
            ),
        ],
        "tests": ["tests/unit/runtime/generating/test_token_sync.py"],
    },
    "token_sync_off_where_forwards_draw": {
        "what": "generate skips transformers' per-token sync where the forwards draw random numbers (dropout)",
        "edits": [
            (
                "accel_gradsync/runtime/generating/token_sync.py",
                "self.draws[training] = not same_states(*states)",
                "self.draws[training] = False",
            ),
        ],
        "tests": ["tests/unit/runtime/generating/test_token_sync.py"],
    },
    "replay_trusted_where_draws_read_the_cache": {
        "what": "a generation whose draws depend on the cache (attention dropout) runs unsynced and replays",
        "edits": [
            (
                "accel_gradsync/runtime/generating/draw_replay.py",
                "        return same_states(generator_states(), after)",
                "        return True",
            ),
        ],
        "tests": [
            "tests/unit/runtime/generating/test_token_sync.py",
            "tests/distributed/test_uneven_generation.py::"
            "test_a_generation_drawing_random_numbers_keeps_the_sync_and_stocks_random_state",
        ],
    },
    "step_n_clip_between_micro_batches_allowed": {
        "what": "step(n): a clip between two of a rank's micro-batches under FSDP is let through, not refused",
        "edits": [
            (
                "accel_gradsync/runtime/uneven_inputs/uneven_steps.py",
                'if any(adapter is not None and adapter.kind != "ddp" for adapter in self.state.adapters.values()):',
                "if False:",
            )
        ],
        "tests": ["tests/distributed/test_uneven_steps.py::test_bad_uses_are_refused_in_one_line"],
    },
    "canary_launched_ranks_import_the_copy": {
        "what": "(the tool's own check) the package fails to import in a launched rank: caught only if the "
        "ranks a test launches import the copy",
        "edits": [
            (
                "accel_gradsync/__init__.py",
                "\nimport importlib\n",
                '\nimport importlib\n\nif "LOCAL_RANK" in __import__("os").environ:\n'
                '    raise ImportError("mutants canary: a launched rank imported the mutated copy")\n',
            )
        ],
        "tests": ["tests/distributed/test_errors.py::test_fsdp_config_without_cpu_enablement_is_refused"],
    },
}


def stale(name: str) -> list[str]:
    """Why mutant `name` no longer applies to REPO's working tree (empty: it applies)."""
    problems = []
    for file, old, new in MUTANTS[name]["edits"]:
        path = REPO / file
        count = path.read_text().count(old) if path.is_file() else 0
        if count != 1:
            problems.append(f"{file}: the text to replace occurs {count} times, not once: {old!r}")
        if old == new:
            problems.append(f"{file}: the replacement is the text itself: {old!r}")
    for test in MUTANTS[name]["tests"]:
        if not (REPO / test.split("::")[0]).exists():
            problems.append(f"no test {test}")
    return problems


def copy_repo(dest: Path) -> None:
    """The files git tracks or would track (not ignored), as they are in REPO's working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def mutate(copy: Path, name: str) -> None:
    for file, old, new in MUTANTS[name]["edits"]:
        path = copy / file
        text = path.read_text()
        assert text.count(old) == 1, (name, file)  # checked by `stale` first
        path.write_text(text.replace(old, new))


def environment(copy: Path) -> dict[str, str]:
    paths = [str(copy), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "HF_HUB_OFFLINE": "1"}


def check_imports_the_copy(copy: Path, env: dict[str, str]) -> None:
    where = subprocess.run(
        [sys.executable, "-c", "import accel_gradsync; print(accel_gradsync.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy's tests would import accel_gradsync from {where}, not from {copy}")


def run_one(name: str, pytest_args: list[str], timeout: float, verbose: bool = False) -> tuple[str, str]:
    """(caught | missed | error, what pytest said) for mutant `name`; `verbose`: pytest's output too."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repo(copy)
        env = environment(copy)
        check_imports_the_copy(copy, env)
        mutate(copy, name)
        # test_mutants.py finds the mutated text changed in the copy: a failure that proves nothing.
        ignore = "--ignore=tests/repo/test_mutants.py"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", ignore, *pytest_args, *MUTANTS[name]["tests"]]
        try:
            done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "error", f"the tests ran over {timeout:.0f} s"
    if verbose:
        print(done.stdout[-6000:], done.stderr[-3000:], sep="\n")
    failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.M)
    summary = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:] or ["(no output)"]
    if done.returncode == 1:  # tests ran and failed
        return "caught", failed[0] if failed else summary[0]
    if done.returncode == 0:
        return "missed", summary[0]
    return "error", f"pytest exit {done.returncode}: {summary[0]}"  # a collection error, no tests, ...


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="name each mutant, what it breaks and its tests")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for one mutant's tests")
    parser.add_argument("--verbose", action="store_true", help="print the end of each mutant's pytest output")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '--slow'")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MUTANTS]
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; --list names them")
    if args.list:
        for name, mutant in MUTANTS.items():
            print(f"{name}: {mutant['what']}\n    tests: {' '.join(mutant['tests'])}")
        return 0
    names = args.names or list(MUTANTS)
    results = {}
    for name in names:
        problems = stale(name)
        if problems:
            results[name] = ("stale", "; ".join(problems))
        else:
            start = time.monotonic()
            outcome, detail = run_one(name, args.pytest_args.split(), args.timeout, args.verbose)
            results[name] = (outcome, f"{detail} ({time.monotonic() - start:.0f} s)")
        print(f"{results[name][0]:7} {name}: {results[name][1]}", flush=True)
    bad = [n for n, (outcome, _) in results.items() if outcome != "caught"]
    print(f"{len(names) - len(bad)} of {len(names)} mutants caught" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
