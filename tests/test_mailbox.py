"""Per-step records reach rank 0 in order, without the ranks waiting for each other."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from trainwright.dist.mailbox import SLOT_BYTES, Mailbox
from trainwright.dist.testing import run_workers


def _records(rank, world):
    box = Mailbox(dist.new_group(backend="gloo"), rank, world)
    big = "x" * (2 * SLOT_BYTES)  # over one slot: travels as a second message
    for step in range(1, 7):
        record = {"rank": rank, "step": step, "blob": big if step == 3 else ""}
        if rank == 2 and step == 2:
            time.sleep(0.5)  # a slow rank: rank 0 waits only for what it reads now
        box.post(record)
        if rank == 0 and step > 1:  # rank 0 reads the others' previous record
            got = [box.take(src) for src in range(1, world)]
            assert [(g["rank"], g["step"]) for g in got] == [(r, step - 1) for r in (1, 2)]
            assert all(len(g["blob"]) == (2 * SLOT_BYTES if step - 1 == 3 else 0) for g in got)
    if rank == 0:
        assert [box.take(src)["step"] for src in (1, 2)] == [6, 6]
    box.close()  # the others end their streams; rank 0 reads the empty last records
    dist.barrier()


def _sender_runs_ahead(rank, world):
    """Rank 1 posts four records before rank 0 reads any: its sends stay in flight and it
    does not block on rank 0. Rank 0 reads only after the barrier, which rank 1 reaches only
    after its four posts: a post that waited for rank 0 would deadlock here (and fail at
    run_workers' time-out), however slow the machine."""
    box = Mailbox(dist.new_group(backend="gloo"), rank, world)
    if rank == 1:
        for step in range(4):
            box.post(step)
        dist.barrier()
    else:
        dist.barrier()  # rank 1 has posted all four
        assert [box.take(1) for _ in range(4)] == [0, 1, 2, 3]
    box.close()


def _no_records(rank, world):
    box = Mailbox(dist.new_group(backend="gloo"), rank, world)
    box.close()  # rank 0 posted a receive per rank at the start: close must still end
    dist.barrier()


@pytest.mark.timeout(420)  # three groups: ~35 s idle, more on a loaded machine
def test_mailbox_delivers_records_in_order_big_ones_included():
    run_workers(_records, 3, timeout_s=120)
    run_workers(_sender_runs_ahead, 2, timeout_s=120)
    run_workers(_no_records, 2, timeout_s=120)


def _train_without_cost_gathers(rank, world, cfg, run_dir):
    from pathlib import Path

    from trainwright.run.trainer import Trainer
    from trainwright.run.worker import train

    def refuse(self, obj):
        raise AssertionError("a profile step with nothing to re-partition gathered costs")

    Trainer._all_gather_pipeline = refuse
    train(cfg, Path(run_dir))


@pytest.mark.timeout(180)
def test_profile_step_costs_ride_with_the_stats(tiny):
    """At a profile step with no re-partition check due, every stage's per-layer costs reach
    rank 0's ``layers`` row with its stats, without a collective lining the ranks up."""
    import json

    from trainwright.run.launch import create_run_dir
    cfg = tiny(**{"parallel.pp": 2, "parallel.dp": 2, "train.steps": 4,
                  "run.profile_every": 2, "train.micro_batches": 2})
    run_dir = create_run_dir(cfg)
    run_workers(_train_without_cost_gathers, 4, cfg, str(run_dir), timeout_s=150)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    layers = {r["step"]: r["layers"] for r in rows if r["kind"] == "layers"}
    assert sorted(layers) == [2, 4]
    n_layers = 2 + cfg.model.n_blocks  # embedding, blocks, head
    for got in layers.values():
        assert [c["layer"] for c in got] == list(range(n_layers))
        assert {c["stage"] for c in got} == {0, 1}
        assert all(c["forward_s"] > 0 for c in got)
