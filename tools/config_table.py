"""Print the README's configuration table from trainwright/config/sections.py (field docstrings)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from trainwright.config import SECTIONS, Config


def docs() -> dict[tuple[str, str], str]:
    """``(class name, field) -> docstring`` read from the source."""
    source = Path(__file__).parents[1] / "trainwright" / "config_sections.py"
    tree = ast.parse(source.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:], strict=False):
                if (isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
                        and isinstance(b.value, ast.Constant)):
                    out[(node.name, a.target.id)] = " ".join(b.value.value.split())
    return out


def main() -> None:
    """Print the markdown table."""
    d, cfg = docs(), Config()
    print("| key | default | meaning |\n|---|---|---|")
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            print(f"| `{section}.{f.name}` | `{value!r}` | {d.get((cls.__name__, f.name), '')} |")


if __name__ == "__main__":
    main()
