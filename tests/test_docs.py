"""The docs match the code: package docstrings list their modules, and the step walk of
``docs/architecture.md`` names files, functions, classes and methods that exist.

Both read the live tree, so a module added, moved or renamed fails here until its package
docstring and the walk say so."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainwright"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def _named(stem: str, text: str) -> bool:
    """Whether ``stem`` stands in ``text`` as a whole word (``sparse`` is not in ``rowsparse``)."""
    return re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", text) is not None


def missing_modules(package: Path) -> list[str]:
    """The modules of ``package`` (``*.py`` stems but ``__init__``) its docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    stems = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    return [stem for stem in stems if not _named(stem, doc)]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_package_docstring_names_every_module(package):
    missing = missing_modules(package)
    assert not missing, (f"{package.relative_to(ROOT)}/__init__.py's docstring does not name "
                         f"{missing}: add a line for each to the docstring")


def test_missing_modules_reads_whole_words(tmp_path):
    (tmp_path / "__init__.py").write_text('"""* :mod:`.rowsparse`, ``dense``."""\n')
    for stem in ("rowsparse", "sparse", "dense", "__main__"):
        (tmp_path / f"{stem}.py").write_text("")
    assert missing_modules(tmp_path) == ["__main__", "sparse"]


# --- docs/architecture.md's step walk -------------------------------------------------

CODE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")
"""A backticked name the walk must find: ``name`` or ``Class.method``."""


def hop_rows(doc: str) -> list[str]:
    """The rows of the hop table (``| 1 | ... |``)."""
    return [line for line in doc.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]


def defined_names(source: str) -> set[str]:
    """Module-level functions and classes, and methods as both ``Class.method`` and ``method``."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.update({f"{node.name}.{item.name}", item.name})
    return names


def is_code_name(token: str) -> bool:
    """Whether a backticked token names one of our functions, methods or classes.

    Not: paths and file names (``a/b.py``, ``metrics.jsonl``), names qualified by a
    lower-case module (``torch.distributed.init_process_group``, ``nn.Linear``: torch's,
    and config keys such as ``eval.every``), upper-case action kinds (``SEND_F``, ``W``)
    and expressions (``(x, dy)``)."""
    if not CODE_NAME.fullmatch(token) or token.isupper():
        return False
    head = token.split(".")[0]
    return "." not in token or head[0].isupper()


def row_paths(row: str) -> list[str]:
    """Backticked paths of a row: ``trainwright/x/y.py``, ``x/y.py`` or a bare ``y.py``."""
    return [t for t in re.findall(r"`([^`]+)`", row)
            if re.fullmatch(r"[\w./]+\.py", t)]


def resolve(path: str, row: list[str]) -> list[Path]:
    """Where a row's path may be: from the root, under the package, or beside the row's
    other files when bare (``sparse.py`` in ``sync/dense.py``'s row)."""
    if path.startswith(("trainwright/", "tests/")):
        return [ROOT / path]
    if "/" in path:
        return [PACKAGE / path]
    return [p.parent / path for other in row if "/" in other for p in resolve(other, row)]


def check_row(row: str) -> list[str]:
    """What a hop row names that is not there."""
    problems = []
    paths = row_paths(row)
    files = []
    for path in paths:
        found = [p for p in resolve(path, paths) if p.is_file()]
        if not found:
            problems.append(f"`{path}` is not a file")
        files += found
    defined = set()
    for file in files:
        defined |= defined_names(file.read_text())
    for token in re.findall(r"`([^`]+)`", row):
        if is_code_name(token) and token not in defined:
            problems.append(f"`{token}` is in none of {[str(f.relative_to(ROOT)) for f in files]}")
    return problems


def test_architecture_hops_name_what_exists():
    rows = hop_rows(ARCHITECTURE.read_text())
    assert rows, "docs/architecture.md has no hop table (| 1 | `file` | what happens |)"
    problems = [f"hop {row.split('|')[1].strip()}: {p}" for row in rows for p in check_row(row)]
    assert not problems, ("docs/architecture.md's step walk names what the code does not "
                          "hold; fix the row:\n" + "\n".join(problems))


def test_check_row_finds_names_in_the_rows_files():
    row = ("| 1 | `trainwright/run/trainer.py` (`Trainer.fit`, `train_step`, `_nope`, "
           "`Trainer.nope`), `sync/dense.py` or `sparse.py`, `nowhere.py` | `SYNC`, "
           "`torch.distributed.init_process_group`, `eval.every`, `metrics.jsonl`, `(x, dy)` |")
    assert check_row(row) == [
        "`nowhere.py` is not a file",
        "`_nope` is in none of ['trainwright/run/trainer.py', 'trainwright/sync/dense.py', "
        "'trainwright/sync/sparse.py']",
        "`Trainer.nope` is in none of ['trainwright/run/trainer.py', "
        "'trainwright/sync/dense.py', 'trainwright/sync/sparse.py']",
    ]


# --- the README as a front page -------------------------------------------------------

README = ROOT / "README.md"
COMMANDS = ("pip install torch==2.13.0 -e . && trainwright run",
            "pip install torch==2.13.0 -e '.[test]' && python -m pytest")


def front_page_problems(text: str) -> list[str]:
    """What keeps ``text`` from being the README's front page."""
    problems = []
    lines = text.splitlines()
    if len(lines) > 300:
        problems.append(f"{len(lines)} lines, at most 300: move run history and tables to "
                        "docs/bench/README.md and details to docs/")
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)[:2]
    if blocks != list(COMMANDS):
        problems.append(f"the README must open with the two commands {COMMANDS}; "
                        f"its first bash blocks are {blocks}")
    return problems


def test_readme_is_a_front_page():
    problems = front_page_problems(README.read_text())
    assert not problems, "\n".join(problems)


def test_readme_config_rows_are_the_generated_ones():
    """The README's essential keys are rows of docs/configuration.md's table, verbatim
    (tests/test_cli.py checks that table against the code)."""
    full = set((ROOT / "docs" / "configuration.md").read_text().splitlines())
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")
            and re.match(r"\| `[a-z_]+\.[a-z_]+` \| `", line)]
    assert rows, "the README has no configuration rows"
    stale = [row.split("|")[1].strip() for row in rows if row not in full]
    assert not stale, f"README rows differ from docs/configuration.md: {stale}; copy them"


def broken_links(page: Path) -> list[str]:
    """Relative markdown links of ``page`` whose file is not there (anchors not checked)."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        path = target.split("#", 1)[0]
        if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_point_at_files(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
