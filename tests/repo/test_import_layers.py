"""Import structure, read with `ast` (nothing is imported): no import cycle among the modules of
accel_gradsync/, benchmarks/, recipes/, testbed/ and tools/, testbed/ imports none of the others but the
package, and each accel_gradsync sub-package imports only
the layers before it: config < compat < planning < runtime < estimator < the top-level modules,
and inside the runtime each room (sub-package) only the rooms before it in `ROOMS`.

Every import statement counts, including those inside functions: a cycle that only a deferred
import breaks is still a cycle to a reader. `python tests/repo/test_import_layers.py` prints
the graph's cycles and layer violations.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("accel_gradsync", "benchmarks", "recipes", "testbed", "tools")
LAYERS = ("config", "compat", "planning", "runtime", "estimator")
ROOMS = ("wrappers", "core", "generating", "accumulation", "faults", "uneven_inputs", "integration")
"""The runtime's sub-packages, each importing only those before it; `runtime.handle` comes last."""
MOST_MODULES = 12  # no folder of the package holds more directly
# recipes/ is not a package: its scripts import each other by bare name (the script's folder is on sys.path).
BARE = "recipes"


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module under ROOTS."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports: `import a.b`, `from a import b` (module b, else a itself),
    relative imports, and recipes' bare-name imports of each other."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        if target in known:
            return target
        if f"{BARE}.{target}" in known and name.startswith(BARE + "."):
            return f"{BARE}.{target}"
        return None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if resolve(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        for target in targets:
            if (hit := resolve(target)) is not None and hit != name:
                found.add(hit)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(name: str) -> int | None:
    """0.. for the sub-packages in LAYERS order, len(LAYERS) for accel_gradsync's top-level
    modules, None outside the package."""
    parts = name.split(".")
    if parts[0] != "accel_gradsync":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    return _violations(edges, layer, LAYERS, "a later layer")


def _violations(edges: dict[str, set[str]], rank, names: tuple, what: str) -> list[str]:
    """Each import from a module ranked 0..len(names)-1 by `rank` of a module ranked higher
    (a module ranked len(names), the top, may import anything)."""
    out = []
    for name, targets in sorted(edges.items()):
        own = rank(name)
        if own is None or own == len(names):
            continue
        for target in sorted(targets):
            theirs = rank(target)
            if theirs is not None and theirs > own:
                out.append(f"{name} ({names[own]}) imports {target} ({what})")
    return out


def room(name: str) -> int | None:
    """0.. for the runtime's rooms in ROOMS order, len(ROOMS) for the runtime's own modules
    (`handle`), None outside the runtime."""
    parts = name.split(".")
    if parts[:2] != ["accel_gradsync", "runtime"]:
        return None
    return ROOMS.index(parts[2]) if len(parts) > 2 and parts[2] in ROOMS else len(ROOMS)


def room_violations(edges: dict[str, set[str]]) -> list[str]:
    return _violations(edges, room, ROOMS, "a later room of the runtime")


def crowded_folders() -> list[str]:
    """Folders of the package holding more than MOST_MODULES modules directly."""
    folders = [p for p in (REPO / "accel_gradsync").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    counts = {
        f: len([m for m in f.glob("*.py") if m.name != "__init__.py"]) for f in [REPO / "accel_gradsync", *folders]
    }
    return [f"{f.relative_to(REPO)}: {n}" for f, n in sorted(counts.items()) if n > MOST_MODULES]


def test_each_runtime_room_imports_only_the_rooms_before_it():
    assert set(ROOMS) == {
        p.name for p in (REPO / "accel_gradsync" / "runtime").iterdir() if (p / "__init__.py").exists()
    }
    assert room_violations(graph()) == []


def test_no_folder_of_the_package_holds_more_than_twelve_modules():
    assert crowded_folders() == []


def test_the_graph_sees_the_packages_imports():
    edges = graph()
    assert "accel_gradsync.planning.costs" in edges["accel_gradsync.estimator.core"]
    assert any(t.startswith("benchmarks.") for t in edges["benchmarks.run"])


def test_the_testbed_stands_on_nothing_the_benchmarks_or_recipes_hold():
    edges = graph()
    assert "testbed.cluster" in edges["testbed.launch"]
    assert [
        f"{a} -> {b}" for a in edges if a.startswith("testbed") for b in edges[a] if b.split(".")[0] != "testbed"
    ] == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_each_layer_imports_only_the_layers_before_it():
    assert layer_violations(graph()) == []


if __name__ == "__main__":
    edges = graph()
    for cycle in cycles(edges):
        print("cycle:", " <-> ".join(cycle))
    for line in layer_violations(edges):
        print("layer:", line)
    for line in room_violations(edges):
        print("room:", line)
    for line in crowded_folders():
        print("crowded:", line)
