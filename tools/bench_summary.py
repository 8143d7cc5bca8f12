"""Rewrites README.md's benchmark table from docs/bench/*.json (every target judged on the
far end of its 90 % interval: trainwright/bench/targets.py). ``--check`` only compares."""

from __future__ import annotations

import sys
from pathlib import Path

from trainwright.bench.targets import summary_table

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench-summary:start -->\n", "<!-- bench-summary:end -->"


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + START + summary_table(ROOT / "docs" / "bench") + END + tail
    if "--check" in argv:
        if new != text:
            print("README.md's benchmark table is stale: run python tools/bench_summary.py")
            return 1
        return 0
    readme.write_text(new)
    print("README.md: benchmark table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
