"""Figures the docs quote from a bench match the committed JSON (issue: benchmarks a
sceptic accepts).

* README.md's benchmark table is generated from docs/bench/*.json
  (:mod:`trainwright.bench.targets`); it must equal what the JSONs give today.
* A figure quoted in prose carries a marker right after it, ``<!-- bench:FILE KEY/PATH -->``
  (FILE: a JSON stem under docs/bench): the number (or the bold / code text) before the
  marker must equal the JSON's value, rounded to the digits quoted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainwright.bench.targets import TARGETS, lookup, summary_table

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
MARK = re.compile(r"(?:\*\*(?P<bold>[^*]+)\*\*|`(?P<code>[^`]+)`|(?P<num>-?\d[\d.]*[x%s]?))"
                  r"<!--\s*bench:(?P<file>[\w.-]+)\s+(?P<path>\S+)\s*-->")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_benchmark_table_is_the_one_the_jsons_give():
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- bench-summary:start -->\n", 1)[1].split(
        "<!-- bench-summary:end -->", 1)[0]
    assert block == summary_table(BENCH), "stale: run python tools/bench_summary.py"


def _matches(quoted: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return quoted.strip("*`") == str(value)
    try:
        number = float(quoted.rstrip("x%s"))
    except ValueError:
        return False
    digits = len(quoted.rstrip("x%s").split(".")[1]) if "." in quoted else 0
    return round(float(value), digits) == number


def marked_figures() -> list[tuple[str, str, str, str]]:
    out = []
    for doc in DOCS:
        for m in MARK.finditer(doc.read_text()):
            quoted = m["bold"] or m["code"] or m["num"]
            out.append((doc.relative_to(ROOT).as_posix(), quoted, m["file"], m["path"]))
    return out


def test_every_marked_figure_equals_its_json():
    figures = marked_figures()
    assert figures, "no marked figure found: the marker pattern or the docs changed"
    wrong = []
    for doc, quoted, stem, path in figures:
        data = json.loads((BENCH / f"{stem}.json").read_text())
        value = lookup(data, path)
        if value is None or not _matches(quoted, value):
            wrong.append(f"{doc}: {quoted!r} but docs/bench/{stem}.json {path} = {value!r}")
    assert not wrong, "\n".join(wrong)


def test_a_wrong_figure_is_caught():
    assert _matches("0.92", 0.9215) and _matches("1.019", 1.0193)
    assert not _matches("0.93", 0.9215) and not _matches("2.70", 2.88)
    assert _matches("first 7 layers", "first 7 layers") and not _matches("first 6", "first 7")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t.bench}:{t.key}")
def test_every_target_is_of_a_bench_that_exists(target):
    from trainwright.bench import BENCHMARKS

    known = {*BENCHMARKS, "gpu"}  # gpu: tools/gpu_check.sh
    assert target.bench in known, target
