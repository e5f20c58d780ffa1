"""Settings are resolved once, at `attach` (and per row by the estimate, its own entry point), and
only the typed `ResolvedConfig` goes below: no module of `planning/` or `runtime/` imports
`GradSyncConfig`, calls `.resolved()` or parses a setting's text (`config/values.py`'s parsers).
Read with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "accel_gradsync"
BELOW_ATTACH = ("planning", "runtime")
UNRESOLVED = {"GradSyncConfig", "parse_bytes", "parse_bool", "Boolean"}


def unresolved_reads() -> list[str]:
    found = []
    for layer in BELOW_ATTACH:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel_gradsync.config"):
                    found += [f"{where} imports {a.name}" for a in node.names if a.name in UNRESOLVED]
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "resolved":
                    found.append(f"{where} calls {ast.unparse(node.func)}()")
    return found


def test_nothing_below_attach_reads_the_unresolved_config():
    assert unresolved_reads() == []


def test_the_check_sees_an_unresolved_read(tmp_path, monkeypatch):
    (tmp_path / "accel_gradsync" / "runtime").mkdir(parents=True)
    (tmp_path / "accel_gradsync" / "planning").mkdir()
    (tmp_path / "accel_gradsync" / "runtime" / "m.py").write_text(
        "from accel_gradsync.config.settings import GradSyncConfig\n\ndef f(c):\n    return c.resolved()\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "accel_gradsync")
    assert unresolved_reads() == [
        "accel_gradsync/runtime/m.py:1 imports GradSyncConfig",
        "accel_gradsync/runtime/m.py:4 calls c.resolved()",
    ]
