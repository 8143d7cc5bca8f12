"""The package's arrows point down, and no import closes a cycle (lazy imports included).

Every ``import`` statement of every module is read with ``ast``: module level, inside
functions, under ``if TYPE_CHECKING``. The layers, lowest first, are the ones
``docs/architecture.md`` draws; a package may import only packages listed before it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trainwright"

LAYERS = ["errors", "schedule", "plan", "config", "observe", "model", "dist", "sync",
          "tokenring", "pipeline", "rebalance", "run", "bench", "cli"]
"""Lowest first. ``trainwright/__init__.py`` and ``__main__.py`` sit above them all."""

FACADE = {"trainwright", "trainwright.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(module, line)`` of every trainwright module ``name`` imports, resolved to modules."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in known else mod, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] == "trainwright"]


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _graph() -> dict[str, list[tuple[str, int]]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import from a package to one at its level or above, as readable lines."""
    bad = []
    for name, deps in graph.items():
        if name in FACADE:
            continue
        own = _layer(name)
        for dep, line in deps:
            layer = _layer(dep)
            if dep in FACADE or layer not in LAYERS:
                bad.append(f"{name}:{line} imports {dep}, which is not in a known layer")
            elif layer != own and LAYERS.index(layer) > LAYERS.index(own):
                bad.append(f"{name}:{line} imports {dep}: {own}/ is below {layer}/")
    return bad


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Import cycles between modules (Tarjan's strongly connected components).

    Importing ``a.b.c`` from outside ``a.b`` runs ``a/b/__init__.py`` first, so that edge is
    counted too.
    """
    edges: dict[str, set[str]] = {n: set() for n in graph}
    for name, deps in graph.items():
        for dep, _ in deps:
            parts = dep.split(".")
            for k in range(2, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in edges and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_is_in_a_layer():
    packages = {_layer(n) for n in _modules() if n not in FACADE}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_imports_point_down():
    bad = upward_imports(_graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles(_graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = {"trainwright.plan.memory": [("trainwright.pipeline.store", 3)],
             "trainwright.pipeline.store": [("trainwright.plan.memory", 5)],
             "trainwright.pipeline": [], "trainwright.plan": []}
    assert upward_imports(graph) == [
        "trainwright.plan.memory:3 imports trainwright.pipeline.store: plan/ is below pipeline/"]
    assert cycles(graph) == [["trainwright.pipeline.store", "trainwright.plan.memory"]]


def test_the_architecture_doc_matches_the_tree():
    """docs/architecture.md draws every layer and names only files that exist."""
    import re

    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    for layer in LAYERS[1:]:
        assert f"{layer}/" in doc, f"docs/architecture.md does not draw {layer}/"
    for path in set(re.findall(r"`((?:trainwright/)?[a-z_]+/[a-z_/]+\.py)", doc)):
        where = ROOT.parent if path.startswith("tests/") else ROOT
        rel = path.removeprefix("trainwright/")
        assert (where / rel).is_file(), f"docs/architecture.md names {path}, which is not there"
