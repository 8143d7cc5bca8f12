"""memory.limit planning with several chunks per rank (interleaved 1F1B, ZB-V), and the
held micro-batch count, trained for real on 2 gloo ranks against the single-process
reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import check_against_reference, step_rows, train_jobs
from trainwright.dist.testing import run_workers
from trainwright.model.build import build_layers
from trainwright.pipeline.budget import (
    chunked_layer_mems,
    profile_model,
    rank_chunks,
    stage_in_flight,
)
from trainwright.plan.memory import min_feasible_bytes, required_bytes
from trainwright.run.launch import create_run_dir
from trainwright.schedule.actions import build_schedule

SCHEDULES = ("interleaved-1f1b", "zb-v")


def _cfg(tiny, schedule: str, limit: int = 0, planner: str = "greedy"):
    """6 layers (embed, 4 blocks, head) in 4 chunks on 2 ranks; 4 micro-batches."""
    return tiny(**{"parallel.pp": 2, "parallel.virtual_stages": 2,
                   "train.schedule": f'"{schedule}"', "train.micro_batches": 4,
                   "model.n_blocks": 4, "model.d_model": 64, "model.context": 32,
                   "memory.limit": limit, "memory.planner": f'"{planner}"',
                   "memory.host_bandwidth": 2e9})


def _limit(cfg) -> tuple[int, list[int]]:
    """A limit between what the ranks need at least and what keeping everything needs,
    from the planner's own model of the ranks (per chunk), and all-keep per rank."""
    named = build_layers(cfg)
    costs = profile_model(cfg, named)
    chunks = rank_chunks(cfg, cfg.partition(len(named)))
    least, keep = [], []
    for r, flight in enumerate(stage_in_flight(cfg)):
        mems = chunked_layer_mems(costs, chunks[r])
        least.append(min_feasible_bytes(mems, flight))
        keep.append(required_bytes(mems, {}, flight))
    return (max(least) + max(keep)) // 2, keep


def _plans(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "memory_plan"]


def _pairs_peak(actions) -> int:
    """Most (chunk, micro-batch) pairs held at once, walking the action list: a pair is
    held from its F until its W (split backward) or its B."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    live, peak = set(), 0
    for a in actions:
        if a.kind == "F":
            live.add((a.stage, a.mb))
        elif a.kind == release:
            live.discard((a.stage, a.mb))
        peak = max(peak, len(live))
    return peak


@pytest.mark.timeout(400)
def test_memory_limit_plans_chunks_and_trains_like_the_reference(tiny):
    cfgs, limits = [], []
    for schedule, planner in zip(SCHEDULES, ("greedy", "optimal"), strict=True):
        limit, keep = _limit(_cfg(tiny, schedule))
        assert limit < max(keep), (schedule, limit, keep)  # some rank must give something up
        limits.append(limit)
        cfgs.append(_cfg(tiny, schedule, limit, planner))
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(train_jobs, 2, list(zip(cfgs, map(str, dirs), strict=True)), timeout_s=380)
    for cfg, run_dir, limit in zip(cfgs, dirs, limits, strict=True):
        label = cfg.train.schedule
        try:
            check_against_reference(cfg, run_dir)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc
        plans = _plans(run_dir)
        policies = [r["policy"] for p in plans for r in p["layers"]]
        assert set(policies) - {"keep"}, (label, plans)
        sched = build_schedule(cfg.train.schedule, 2, 4, 2)
        for row in step_rows(run_dir):
            for st in row["stages"]:
                assert st["activation_peak_bytes"] <= limit, (label, row["step"], st, limit)
                # the store counts what memory holds: (chunk, micro-batch) pairs
                assert st["held_microbatches_peak"] == _pairs_peak(sched[st["stage"]]), \
                    (label, row["step"], st)


@pytest.mark.timeout(120)
def test_impossible_limit_with_chunks_names_each_rank(tmp_path, capsys):
    from trainwright.cli import main
    code = main(["run", "--set", f'run.dir="{tmp_path}"', "--set", "memory.limit=1000",
                 "--set", 'train.schedule="zb-v"', "--set", "parallel.virtual_stages=2",
                 "--set", "model.n_blocks=2", "--set", "model.d_model=32",
                 "--set", "model.context=16", "--set", "data.name=\"synthetic\""])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "cannot be met even with every layer recomputed" in err
    assert "rank 0" in err and "rank 1" in err
    assert not any(tmp_path.iterdir())
