"""Each piece of state has one owner that changes it through its own methods: no module of
accel_gradsync/ calls a private method (`_name`, not a dunder) that a class of another module
defines. Read with `ast`, nothing imported; `python tests/repo/test_private_methods.py` prints
each such call."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "accel_gradsync"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_calls() -> list[str]:
    """`file:line call` for each call of a private method defined by a class of another module
    (`self.x._method()` or `obj._method()`; `self._method()`, `cls._method()`, `super()._method()`
    are the class's own)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}
    defined: dict[str, set[Path]] = defaultdict(set)  # private method -> the modules whose classes define it
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        defined[item.name].add(path)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, owner = node.func.attr, node.func.value
            if not _private(name) or name not in defined:
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_no_module_calls_a_private_method_of_another():
    assert foreign_private_calls() == []


def test_the_check_sees_a_foreign_private_call(tmp_path, monkeypatch):
    package = tmp_path / "accel_gradsync"
    package.mkdir()
    (package / "owner.py").write_text("class Owner:\n    def _change(self):\n        pass\n")
    (package / "caller.py").write_text("def use(owner):\n    owner._change()\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    assert foreign_private_calls() == ["accel_gradsync/caller.py:2 owner._change"]


if __name__ == "__main__":
    print("\n".join(foreign_private_calls()) or "none")
