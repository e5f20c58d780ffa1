"""Merging the GRPO benchmark's launches: a network's FSDP2 and DDP launches, one round each, become
one run with a row per configuration over every round (hand-built rank records)."""

import dataclasses

from benchmarks import grpo
from benchmarks.records import GrpoRankResult, GrpoRankRun, GrpoStep, PhaseTotals

PHASES = ("generation", "logprob", "scoring", "training")


def step(n, time_s, ref_gathers=0, ref_bytes=0):
    phases = {p: PhaseTotals(time_s=time_s / 4) for p in PHASES}
    phases["logprob"].all_gathers = ref_gathers
    return GrpoStep(
        step=n,
        phases=phases,
        time_s=time_s,
        cpu_s=time_s,
        held_grad_bytes=10,
        held_param_bytes=0,
        rss_growth_bytes=1,
        state_bytes=100 + ref_bytes,
        ref_unsharded_bytes=ref_bytes,
    )


def rank_run(config, r, time_s, first_gathers=0, ref_bytes=0):
    return GrpoRankRun(
        config=config,
        round=r,
        steps=[step(2, time_s, ref_bytes=ref_bytes)],
        first_step=step(1, 9.0, ref_gathers=first_gathers, ref_bytes=ref_bytes),
        units=6 if config != "full/ddp" else 0,
        ref_units=1 if config == "full/windowed" else 0,
        logs=[{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}],
        completions=[f"{config}{r}"],
        rewards=[[0.5]],
    )


def launch(configs, r, times, backend=None):
    """One launch of one round: two ranks, rank 1 slower by 1 s on every step."""
    ranks = [
        GrpoRankResult(
            size="quick",
            facts={"params": 1},
            pinned_core=rank,
            runs=[rank_run(c, r, t + rank, **extra) for c, (t, extra) in zip(configs, times, strict=True)],
            versions={},
            backend_ms=backend or {},
        )
        for rank in (0, 1)
    ]
    out = grpo.launch_of([dataclasses.asdict(rank) for rank in ranks])
    out.wall_s = 10.0
    return out


def test_a_networks_launches_merge_into_one_row_per_configuration_over_every_round():
    resident = {"first_gathers": 1, "ref_bytes": 50}
    launches = []
    for r, (window_s, ddp_s, all_gather) in enumerate([(2.0, 1.0, 30.0), (5.0, 1.5, 10.0), (3.0, 2.0, 20.0)]):
        backend = {"all_gather": all_gather, "reduce_scatter": 1.0, "all_reduce": 1.0}
        launches.append(launch(["full/windowed"], r, [(window_s, resident)], backend))
        launches.append(launch(["full/ddp"], r, [(ddp_s, {})]))
    run = grpo.combine(launches)
    ddp, window = run.rows  # in configuration order
    assert (ddp.config, window.config) == ("full/ddp", "full/windowed")
    # Each step is its slowest rank's (rank 1: +1 s), tagged with the round its launch ran.
    assert window.step_times_s == [3.0, 6.0, 4.0] and window.step_rounds == [0, 1, 2]
    assert ddp.step_times_s == [2.0, 2.5, 3.0] and window.step_time_s == 4.0
    # Step 1's log-prob all-gathers are kept apart from the timed steps: per round, steps 1, 2.
    assert window.logprob_gathers == [[1, 0], [1, 0], [1, 0]]
    assert (window.ref_units, window.ref_unsharded_bytes, window.state_bytes) == (1, 50, 150)
    assert window.completions == [
        [["full/windowed0"], ["full/windowed0"]],
        [["full/windowed1"]] * 2,
        [["full/windowed2"]] * 2,
    ]
    assert len(window.logs) == 3
    # The backend's collectives: the median over FSDP2's launches (DDP's do not time them).
    assert run.backend_ms == {"all_gather": 20.0, "reduce_scatter": 1.0, "all_reduce": 1.0}
    assert run.wall_s == 60.0 and run.pinned_cores == [0, 1]
