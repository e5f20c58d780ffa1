"""benchmarks/ stays a room a reader can walk through: at most 3,000 lines of Python. What the tests
and the benchmarks both run on lives in testbed/, by-hand checks in tools/; a new benchmark or
target pays for itself by sharing what is there (`stats.write_report`, `records`, `measure`)."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MOST_LINES = 3000


def test_benchmarks_hold_at_most_3000_lines():
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted(BENCHMARKS.rglob("*.py"))}
    assert sum(lines.values()) <= MOST_LINES, sorted(lines.items(), key=lambda kv: -kv[1])
