"""Test modules share helpers through helper modules, never through each other.

A helper imported from ``tests/test_x.py`` drags that module's tests and fixtures into
the importer's namespace and ties two test files together; shared code lives in
``tests/helpers.py``, ``tests/torch_reference.py``, ``tests/factories.py`` or
``tests/conftest.py``. Every ``import`` statement is read with ``ast``, lazy ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported(node: ast.AST) -> list[str]:
    """Modules (and ``from tests import x`` submodules) that one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        base = node.module if not node.level else f"tests.{node.module}"
        return [base] + [f"{base}.{a.name}" for a in node.names]
    if isinstance(node, ast.ImportFrom):  # from . import x
        return [f"tests.{a.name}" for a in node.names]
    return []


def _test_module_imports() -> list[str]:
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = {".".join(m.split(".")[:2]) for m in _imported(node)}
            found += [f"{path.name}:{node.lineno} imports {m}" for m in sorted(mods)
                      if m.startswith("tests.test_")]
    return found


def test_no_test_module_imports_another_test_module():
    found = _test_module_imports()
    assert not found, ("move shared helpers into tests/helpers.py (or conftest.py, "
                       "factories.py, torch_reference.py) and import them from there:\n"
                       + "\n".join(found))
