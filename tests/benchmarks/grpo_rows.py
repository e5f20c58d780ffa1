"""Hand-built GRPO benchmark rows and results for the report's and the checks' tests."""

from benchmarks.records import GrpoResults, GrpoRow, GrpoRun

PHASES = ("generation", "logprob", "scoring", "training")


def row(config, times, rounds, gen_gathers=6, train_gathers=0, units=6, loss=0.5, **fields):
    counts = {p: {"all_gathers": [0], "reduce_scatters": [0], "all_reduces": [0]} for p in PHASES}
    counts["generation"]["all_gathers"], counts["training"]["all_gathers"] = [gen_gathers], [train_gathers]
    return GrpoRow(
        config=config,
        units=units,
        step_times_s=times,
        step_rounds=rounds,
        counts_seen=counts,
        logs=[[{"step": 1, "loss": loss, "reward": 0.5}]],
        rewards=[[[0.5, 0.25]]],
        completions=[[["abc"], ["def"]]],
        **fields,
    )


def results(rows, link=None, quick=False, beta=0.0, backend_ms=None):
    run = GrpoRun(size="quick", facts={"params": 2**20}, rows=rows, link=link, backend_ms=backend_ms or {})
    return GrpoResults(command="", plan={"quick": quick, "beta": beta}, machine={}, elapsed_s=1, runs=[run])


def status(checked, start):
    return {r.target: (r.status, r.measured) for r in checked if r.target.startswith(start)}
