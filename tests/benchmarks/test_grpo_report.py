"""The GRPO benchmark's report on hand-built rows: the table's medians and spreads, the lines under
it, and results.json's round trip (the targets: test_grpo_checks.py)."""

import dataclasses
import json

from grpo_rows import PHASES, results, row

from benchmarks import grpo_report
from benchmarks.records import GrpoResults

MiB = 2**20


def with_phases(r):
    r.phase_time_s = dict.fromkeys(PHASES, 0.1)
    r.counts_per_step = {p: {"all_gathers": 0, "reduce_scatters": 0, "bytes_sent": 0} for p in PHASES}
    return r


def test_the_table_shows_the_median_step_and_the_spread_of_the_rounds():
    ddp = with_phases(row("full/ddp", [1.0, 1.0, 1.0], [0, 1, 2], state_bytes=4 * MiB))
    window = with_phases(row("full/windowed", [1.9, 1.05, 1.08], [0, 1, 2], state_bytes=3 * MiB))
    window.step_time_s, ddp.step_time_s = 1.08, 1.0
    run = results([ddp, window]).runs[0]
    line = grpo_report.table_row(run, window)
    # step ms: the median, the rounds' min-max; x DDP: the median of the per-round ratios and their spread.
    assert line.startswith("| full/windowed | 1080 (1050-1900) | - | 1.08x (1.05-1.90x) | "), line
    assert line.endswith("| 3.00 | 0.75x | 0 |"), line
    assert grpo_report.table_row(run, ddp).startswith("| full/ddp | 1000 (1000-1000) | - | 1.00x | ")
    one_round = with_phases(row("full/windowed", [1.5], [0]))
    one_round.step_time_s = 1.5
    assert grpo_report.table_row(results([one_round]).runs[0], one_round).startswith("| full/windowed | 1500 | - | - |")


def test_a_resident_reference_model_gets_a_line_with_its_bytes_and_gathers():
    ddp = row("full/ddp", [1.0], [0], state_bytes=4 * MiB)
    window = row("full/windowed", [1.0], [0], state_bytes=3 * MiB, ref_unsharded_bytes=MiB, ref_units=1)
    window.logprob_gathers = [[1, 0], [1, 0]]
    run = results([ddp, window]).runs[0]
    line = grpo_report.resident_line(run, window)
    assert "1.00 MiB of its unsharded params stay on every rank" in line
    assert "its state of 3.00 MiB per rank against DDP's 4.00 MiB" in line
    assert line.endswith("steps 1, 2, ... of each round: 1, 0; 1, 0."), line
    assert grpo_report.resident_line(run, ddp) is None  # nothing kept resident


def test_the_collectives_alone_line_under_the_table():
    backend = {"all_gather": 30.0, "reduce_scatter": 50.0, "all_reduce": 40.0}
    line = grpo_report.backend_line(results([row("full/ddp", [1.0], [0])], backend_ms=backend).runs[0])
    assert "all-gather 30 ms, reduce-scatter 50 ms, all-reduce 40 ms" in line and "costs 2.00x it" in line
    assert "4.0 MiB" in line


def test_results_survive_the_json_round_trip():
    stock = row("full/stock", [1.0, 1.2], [0, 1], ref_units=1, ref_unsharded_bytes=MiB)
    stock.phase_time_s, stock.handle_held_grad_bytes = {"generation": 0.5, "training": 0.5}, None
    stock.logprob_gathers = [[1, 0], [1, 0]]
    before = results([stock], link="1gbit")
    assert GrpoResults.from_dict(json.loads(json.dumps(dataclasses.asdict(before)))) == before
