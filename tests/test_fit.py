"""A plan under a limit fits, by the meter: plan from the profile, run, meter every stage.

The footprint model (:mod:`trainwright.plan.footprint`) predicts each rank's activation peak
from one profile; ``memory.limit`` planning is held to it. The live-storage meter
(:mod:`trainwright.bench.live_meter`), not the store's own count, decides whether a stage
fit: every stage of every configuration must stay at or under its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwright.config import load_config
from trainwright.model.build import build_layers
from trainwright.pipeline.budget import predicted_footprints
from trainwright.pipeline.profile import profile_model

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.n_blocks=2", "model.d_model=64", "model.n_heads=4", "model.context=32",
        'model.factory="trainwright.bench.live_meter:bench_gpt"',
        'data.factory="trainwright.bench.live_meter:bench_data"', "data.max_bytes=200000",
        "train.optimizer=sgd", "train.lr=0.01", "parallel.threads_per_rank=1",
        "run.report=false", "run.progress=false", "run.checkpoint_every=0",
        "run.trace_steps=0", "run.profile_every=1000", "train.steps=4",
        'memory.planner="optimal"', "memory.host_bandwidth=1e9"]
METERED_STEPS = 3  # steps 2 and 3 are metered; the worst of them counts


def _config(pp: int, mbs: int, schedule: str, extra: tuple = ()) -> list[str]:
    return [*BASE, f"parallel.pp={pp}", f"train.batch_size={2 * mbs}",
            f"train.micro_batches={mbs}", f'train.schedule="{schedule}"', *extra]


def plan_run_meter(sets: list[str], fraction: float, work: Path) -> dict:
    """:func:`_plan_run_meter` with the benchmarks' split model (``TW_BENCH_SPLIT``) for
    this call only: a variable left set would change the model of every later test."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"TW_BENCH_SPLIT": "1"}):
        return _plan_run_meter(sets, fraction, work)


def _plan_run_meter(sets: list[str], fraction: float, work: Path) -> dict:
    """Limit every stage to ``fraction`` of the way from the smallest predicted peak (every
    layer swapped or recomputed, the better) to the largest all-keep one, plan, train with
    ``trainwright run`` under the live meter; predicted and metered peaks."""
    cfg = load_config(None, sets)
    table = profile_model(cfg, build_layers(cfg))
    keep = max(f.activations for f in predicted_footprints(cfg, table))
    pp = cfg.parallel.pp
    least = max(min(f.activations for f in fs) for fs in zip(*(
        predicted_footprints(cfg, table, [{c.layer: p for c in table}] * pp)
        for p in ("swap", "recompute")), strict=True))
    limit = int(least + fraction * (keep - least))
    sets = [*sets, f"memory.limit={limit}"]
    planned = predicted_footprints(load_config(None, sets), table)
    name = f"run{len(list(work.iterdir()))}"
    meter_dir = work / f"{name}-meter"
    meter_dir.mkdir()
    env = {**os.environ, "TW_BENCH_METER_DIR": str(meter_dir), "TW_BENCH_SPLIT": "1",
           "TW_BENCH_METER_STEPS": str(METERED_STEPS), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "trainwright", "run"]
    for s in [*sets, f'run.dir="{work}"', f'run.name="{name}"']:
        cmd += ["--set", s]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert got.returncode == 0, got.stderr[-3000:]
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    met = [json.loads((meter_dir / f"rank{r}.json").read_text())
           for r in range(cfg.parallel.pp)]
    return {"limit": limit, "predicted": [f.activations for f in planned],
            "metered": [m["peak_bytes"] for m in met],
            "policies": [x["policy"] for r in rows if r["kind"] == "memory_plan"
                         for x in r["layers"]]}


def _check(label: str, got: dict) -> None:
    limit = got["limit"]
    assert all(p < limit for p in got["predicted"]), (label, "the planner must say it fits", got)
    over = [(s, m) for s, m in enumerate(got["metered"]) if m > limit]
    assert not over, f"{label}: stages over the limit {limit} by the meter: {over}; {got}"
    assert set(got["policies"]) - {"keep"}, (label, "the limit must change some policy", got)


CONFIGS = [(2, 4, "1f1b"), (2, 4, "gpipe"), (2, 4, "zb-h1")]


@pytest.mark.timeout(600)
def test_three_plans_under_a_limit_fit_by_the_meter(tmp_path):
    for pp, mbs, schedule in CONFIGS:
        _check(f"pp={pp} m={mbs} {schedule}",
               plan_run_meter(_config(pp, mbs, schedule), 0.5, tmp_path))


SLOW = [(2, 2, "1f1b", 0.5), (2, 8, "1f1b", 0.3), (2, 8, "gpipe", 0.8), (4, 4, "1f1b", 0.5),
        (4, 8, "gpipe", 0.3), (2, 4, "zb-h2", 0.5), (4, 4, "zb-h1", 0.8), (2, 4, "1f1b", 0.3),
        (4, 8, "1f1b", 0.5), (2, 2, "gpipe", 0.5)]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ten_plans_under_a_limit_fit_by_the_meter(tmp_path):
    for pp, mbs, schedule, fraction in SLOW:
        _check(f"pp={pp} m={mbs} {schedule} at {fraction}",
               plan_run_meter(_config(pp, mbs, schedule), fraction, tmp_path))
