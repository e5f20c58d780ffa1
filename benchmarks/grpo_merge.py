"""The GRPO benchmark's records, merged: each launch's ranks (`GrpoLaunch`, one round of FSDP2's or
of DDP's configurations) -> one `GrpoRun` per network, one `GrpoRow` per configuration, over every
round. A step lasts as long as its slowest rank; counts are rank 0's (every rank issues the same);
memory is the max over ranks and steps.
"""

from __future__ import annotations

from statistics import median

from benchmarks import grpo
from benchmarks.records import GrpoLaunch, GrpoRankResult, GrpoRankRun, GrpoRow, GrpoRun, memory_max

KINDS = ("all_gathers", "reduce_scatters", "all_reduces")


def launch_of(ranks_json: list[dict]) -> GrpoLaunch:
    """One launch's ranks as written; `combine` merges them with the network's other launches."""
    ranks = [GrpoRankResult.from_dict(r) for r in ranks_json]
    return GrpoLaunch(size=ranks[0].size, facts=ranks[0].facts, ranks=ranks)


def combine(launches: list[GrpoLaunch]) -> GrpoRun:
    """The launches of one network (FSDP2's and DDP's, round by round) as one run: each rank's runs
    over every launch merged, rows in configuration order; the backend's collectives, the median
    over the launches that timed them (FSDP2's)."""
    first = launches[0]
    ranks = [
        GrpoRankResult(
            size=first.size,
            facts=first.facts,
            pinned_core=rank.pinned_core,
            runs=[run for launch in launches for run in launch.ranks[i].runs],
            versions=rank.versions,
        )
        for i, rank in enumerate(first.ranks)
    ]
    out = merge(ranks)
    out.rows.sort(key=lambda r: list(grpo.CONFIGS).index(r.config))
    timed = [launch.ranks[0].backend_ms for launch in launches if launch.ranks[0].backend_ms]
    out.backend_ms = {op: median(t[op] for t in timed) for op in timed[0]} if timed else {}
    for name in ("link", "hosts", "ranks_per_host"):
        setattr(out, name, getattr(first, name))
    out.wall_s = round(sum(launch.wall_s or 0 for launch in launches), 1)
    out.link_bytes = sum(launch.link_bytes or 0 for launch in launches) if first.link else first.link_bytes
    return out


def merge(ranks: list[GrpoRankResult]) -> GrpoRun:
    """One row per configuration: each step's time and phase split are its slowest rank's, the row
    has the medians over the timed steps of every round; counts are rank 0's, memory the max."""
    rows = []
    for name in dict.fromkeys(r.config for r in ranks[0].runs):
        per_rank = [[r for r in rank.runs if r.config == name] for rank in ranks]
        rows.append(row_of(name, list(zip(*per_rank, strict=True))))  # one run per round, on every rank
    return GrpoRun(
        size=ranks[0].size,
        facts=ranks[0].facts,
        rows=rows,
        versions=ranks[0].versions,
        pinned_cores=[r.pinned_core for r in ranks],
    )


def row_of(name: str, rounds: list[tuple[GrpoRankRun, ...]]) -> GrpoRow:
    """A configuration's row from its runs: per round, one run on every rank (rank 0's first)."""
    steps = [
        (runs[0].round, max(same, key=lambda s: s.time_s))
        for runs in rounds
        for same in zip(*(run.steps for run in runs), strict=True)
    ]
    rank0_runs = [runs[0] for runs in rounds]
    rank0 = [s for run in rank0_runs for s in run.steps]
    every = [s for runs in rounds for run in runs for s in run.steps]
    phases = list(rank0[0].phases) if rank0 else []
    return GrpoRow(
        config=name,
        units=rank0_runs[0].units,
        ref_units=rank0_runs[0].ref_units,
        step_time_s=median(s.time_s for _, s in steps),
        step_times_s=[s.time_s for _, s in steps],
        step_rounds=[r for r, _ in steps],
        phase_time_s={p: median(s.phases[p].time_s for _, s in steps) for p in phases},
        counts_seen={p: {k: sorted({getattr(s.phases[p], k) for s in rank0}) for k in KINDS} for p in phases},
        counts_per_step={
            p: {k: median(getattr(s.phases[p], k) for s in rank0) for k in (*KINDS, "bytes_sent")} for p in phases
        },
        **memory_max(every, [run.handle_held_grad_bytes for runs in rounds for run in runs]),
        state_bytes=max((s.state_bytes for s in every), default=0),
        ref_unsharded_bytes=max((s.ref_unsharded_bytes for s in every), default=0),
        resident_units=int(rank0_runs[0].stats.get("units_resident", 0)),
        resident_bytes=int(rank0_runs[0].stats.get("resident_param_bytes", 0)),
        logprob_gathers=[
            [s.phases["logprob"].all_gathers for s in ([run.first_step] if run.first_step else []) + run.steps]
            for run in rank0_runs
        ],
        logs=[run.logs for run in rank0_runs],
        rewards=[run.rewards for run in rank0_runs],
        completions=[[run.completions for run in runs] for runs in rounds],
        stats=rank0_runs[-1].stats,
    )
