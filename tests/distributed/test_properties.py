"""Property tests: hypothesis draws training schedules (M, dataloader length, epochs,
sync mode, which micro-batches raise and how) and every schedule runs on a 2-rank FSDP2 gloo
group. Each optimizer step's gradients must equal the single-process reference, the real
reduce-scatters must equal what the mode must issue, derived here from first principles
(expected_counts.py: M x U per step syncing every micro-batch, U deferred, a budget's units from
TinyNet's sizes), and flags and held gradients must come back. Most schedules defer something:
M >= 2 and loaders of 2 micro-batches or more (auto, whose step 1 measures, from its second step).

Hypothesis cannot drive examples across processes, so the schedules are drawn here with a fixed
seed (`derandomize=True`), all of them run in ONE launch, and each is asserted on its own.
CI's default run draws a handful; `--slow` draws many more."""

import json
import tempfile

import pytest
from expected_counts import defers_something, expected_reduce_scatters, syncing_units
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from launcher import accelerate_config, launch
from workers.schedules import positions

MODES = {
    "per_micro_batch": {},
    "deferred": {"defer": True},
    "budget": {"sync_mode": "budget", "memory_budget": "1100B"},  # one Block's 1088 B gradient fits
    # Room for everything: step 1 syncs every micro-batch while auto measures, then every unit
    # is windowed, whatever the process's own memory.
    "auto": {"sync_mode": "auto", "free_memory": "64GiB"},
}
KINDS = ("forward", "after_backward", "keyboard")


@st.composite
def schedules(draw, failures: bool):
    # M = 1 defers nothing (test_reliability_edge.py runs it); a loader may still end inside the first window.
    M = draw(st.integers(2, 4))
    L = draw(st.integers(2, 6))
    epochs = draw(st.integers(1, 2))
    mode = draw(st.sampled_from(sorted(MODES)))
    raises = {}
    if failures:
        for _ in range(draw(st.integers(1, 2))):
            where = (draw(st.integers(0, epochs - 1)), draw(st.integers(0, L - 1)))
            raises[where] = draw(st.sampled_from(KINDS))
    return {
        "M": M,
        "L": L,
        "epochs": epochs,
        "mode": mode,
        "raises": [[e, k, kind] for (e, k), kind in sorted(raises.items())],
    }


def draw(strategy, n: int) -> list[dict]:
    """Up to `n` distinct examples, the same ones on every run."""
    found = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(schedule):
        if schedule not in found:
            found.append(schedule)

    collect()
    return found


def to_specs(drawn: list[dict], prefix: str) -> list[dict]:
    return [{**s, "name": f"{prefix}{i}", "config": MODES[s["mode"]]} for i, s in enumerate(drawn)]


def run_all(specs: list[dict]) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(specs, f)
        f.flush()
        return launch("reliability_edge", ["--specs", f.name], accelerate_config("fsdp2"), timeout=1800)


def check(spec: dict, run: dict) -> None:
    where = f"{spec['name']}: {json.dumps({k: spec[k] for k in ('M', 'L', 'epochs', 'mode', 'raises')})}"
    assert run["error"] is None, (where, run["error"])
    assert run["syncs_as_planned"], f"{where}: a micro-batch synced where the schedule did not end a step"
    assert len(run["steps"]) == run["expected_steps"], (where, len(run["steps"]))
    for step in run["steps"]:
        assert step["max_diff"] <= 1e-5 and not step["missing"] and not step["extra"], (where, step)
    got = [s["reduce_scatters"] for s in run["steps"]]
    assert got == expected_reduce_scatters(spec), (where, got, run["plan"])
    if not spec["raises"]:
        stats, units = run["stats"], syncing_units(spec)
        windows = [p["c"] + 1 for p in positions(spec) if p["final"]]
        assert stats["optimizer_steps"] == len(got) and stats["micro_batches"] == spec["L"] * spec["epochs"]
        assert stats["reduce_scatters_issued"] == sum(got), (where, stats)
        assert stats["reduce_scatters_skipped"] == units * sum(windows) - sum(got), (where, stats)
    assert run["flags_between"] and run["flags_end"], where
    assert all(a["flags_restored"] and a["held_after_zero_grad"] == 0 for a in run["aborts"]), (where, run["aborts"])
    assert all(b == 0 for b in run["held_after_step"]), (where, run["held_after_step"])


def per_mode(failures: bool, n: int, pool: int = 40) -> list[dict]:
    """`n` of `pool` drawn schedules for every mode, so a small CI run still covers each mode;
    the last drawn ones, past hypothesis' first, simplest examples."""
    drawn = draw(schedules(failures), pool)
    return [s for mode in MODES for s in [d for d in drawn if d["mode"] == mode][-n:]]


CLEAN = to_specs(per_mode(failures=False, n=2), "clean")
FAILING = to_specs(per_mode(failures=True, n=2), "failing")


@pytest.fixture(scope="module")
def results():
    ranks = run_all(CLEAN + FAILING)
    return [rank["runs"] for rank in ranks]


def test_schedules_were_drawn():
    assert len(CLEAN) >= 4 and len(FAILING) >= 4
    assert all(s["raises"] for s in FAILING) and not any(s["raises"] for s in CLEAN)


def test_most_drawn_schedules_defer_something():
    """A schedule in which no micro-batch holds a sync checks nothing a plan decides: every mode
    but per_micro_batch defers something in most of them (auto only from its second step)."""
    holding = [s for s in CLEAN + FAILING if s["mode"] != "per_micro_batch"]
    deferring = [s["name"] for s in holding if defers_something(s)]
    assert len(deferring) >= 0.75 * len(holding), (deferring, [s["name"] for s in holding])


@pytest.mark.parametrize("spec", CLEAN, ids=lambda s: s["name"])
def test_drawn_schedule_matches_reference_and_its_counts(results, spec):
    for runs in results:
        check(spec, runs[spec["name"]])


@pytest.mark.parametrize("spec", FAILING, ids=lambda s: s["name"])
def test_drawn_schedule_with_failures_recovers_and_matches_reference(results, spec):
    for runs in results:
        check(spec, runs[spec["name"]])


@pytest.mark.slow
def test_many_drawn_schedules():
    specs = to_specs(draw(schedules(False), 40), "many_clean") + to_specs(draw(schedules(True), 40), "many_failing")
    ranks = run_all(specs)
    for rank in ranks:
        for spec in specs:
            check(spec, rank["runs"][spec["name"]])
