"""Gathers what ``tools/gpu_check.sh`` ran into one JSON (docs/bench/gpu.json) and prints
a summary; exits non-zero when a test failed or the bench did not finish."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def tests_from_junit(path: Path) -> list[dict]:
    """One row per test case of a pytest ``--junitxml`` file: name, outcome, seconds and,
    for a failure, the first lines of its message."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        row = {"test": f"{case.get('classname', '')}::{case.get('name')}",
               "seconds": round(float(case.get("time", 0)), 2), "outcome": "passed"}
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                row["outcome"] = {"failure": "failed", "error": "error"}.get(tag, tag)
                text = (el.get("message") or "") + "\n" + (el.text or "")
                row["message"] = text.strip()[-1500:]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--bench-log", type=Path)
    ap.add_argument("--tests-rc", type=int, required=True)
    ap.add_argument("--bench-rc", type=int, required=True)
    ap.add_argument("--wall-s", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    import torch

    from trainwright.bench.paired import host_info
    tests = tests_from_junit(a.junit)
    bench = json.loads(a.bench.read_text()) if a.bench.exists() else None
    result = {
        "benchmark": "gpu_check", "device": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "host": host_info(), "wall_s": a.wall_s,
        "tests_exit_code": a.tests_rc, "tests": tests,
        "tests_passed": sum(t["outcome"] == "passed" for t in tests),
        "tests_failed": sum(t["outcome"] in ("failed", "error") for t in tests),
        "bench_exit_code": a.bench_rc, "bench_memory_cuda": bench,
    }
    if bench is None and a.bench_log and a.bench_log.exists():
        result["bench_log_tail"] = a.bench_log.read_text()[-3000:]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\ngpu_check on {result['device']} (torch {torch.__version__}, CUDA "
          f"{result['cuda']}), {a.wall_s} s; wrote {a.out}")
    print(f"tests: {result['tests_passed']} passed, {result['tests_failed']} failed")
    for t in tests:
        if t["outcome"] != "passed":
            print(f"  {t['outcome']}: {t['test']}: {t.get('message', '')[:300]}")
    if bench:
        for row in bench["rows"]:
            print(f"  {row['system']:<16} step {row['step_s']:.4f} s  allocator peak/stage "
                  f"{row['allocator_peak_bytes_per_stage']}  fits={row['fits']}")
        for key in ("limit_bytes", "every_stage_within_limit",
                    "ratio_vs_best_fitting_checkpoint", "swap_copy_overlap"):
            print(f"  {key} = {bench.get(key)}")
    else:
        print(f"bench: did not finish (exit {a.bench_rc})")
    return 0 if a.tests_rc == 0 and a.bench_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
