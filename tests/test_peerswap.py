"""Runtime peer swap: same parameters as keeping everything, every device within budget."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from trainwright.devices import DeviceTopology
from trainwright.pipeline.harness import GPTJob, job_batch, job_layers, run_gpt_pipeline
from trainwright.pipeline.peerswap import ChunkMeta, TensorMeta, metadata_table
from trainwright.plan.placement import Rules
from trainwright.plan.planner import PlanRequest, make_plan
from trainwright.tensor_profile import profile_tensors
from trainwright.testing import run_workers


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def plan_for(job: GPTJob, budgets: list[int]) -> dict:
    """Tensor profile of one micro-batch, then the seed 004 planner with peers preferred."""
    layers = job_layers(job)
    x, y = job_batch(job, 0)
    n = job.micro_batch_size
    rows = profile_tensors([(f"layer{i}", m) for i, m in enumerate(layers)], x[:n], y[:n],
                           _loss)
    k = len(job.parts)
    bw = [[0.0 if i == j else 1e9 for j in range(k)] for i in range(k)]
    topo = DeviceTopology("loopback", [max(budgets)] * k, bw, [1e9] * k)
    req = PlanRequest(rows, job.schedule, k, job.micro_batches, topo, budget=budgets,
                      partition=job.parts, rules=Rules(short_s=math.inf, long_s=math.inf))
    return make_plan(req).to_dict()


def _peer_worker(rank: int, world: int, job: GPTJob) -> None:
    keep = run_gpt_pipeline(job)
    peaks: list = [None] * world
    dist.all_gather_object(peaks, max(keep["peak_bytes"]))
    # stage 0 gets 70 % of what it needs keeping everything; the others room for chunks
    budgets = [int(0.7 * peaks[0])] + [p + peaks[0] // 2 for p in peaks[1:]]
    box = [plan_for(job, budgets) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    assert plan["fits"] == [True] * world, plan["fits"]
    assert "0" in plan["peers"] and plan["policy_counts"][0].get("peer", 0) > 0
    swapped = run_gpt_pipeline(job, peer_plan=plan)
    torch.testing.assert_close(swapped["params"], keep["params"], rtol=0, atol=0)
    assert max(swapped["peak_bytes"]) <= budgets[rank], (rank, swapped["peak_bytes"], budgets)
    if rank == 0:
        assert swapped["sent_bytes"] > 0
        assert max(swapped["peak_bytes"]) < peaks[0]
    held: list = [None] * world
    dist.all_gather_object(held, swapped["held_peak_bytes"])
    assert sum(held[1:]) > 0  # later stages really held chunks


@pytest.mark.timeout(180)
def test_peer_swap_training_matches_keep_and_fits_budgets():
    job = GPTJob(n_blocks=4, parts=[2, 2, 1, 1], schedule="1f1b", micro_batches=6, steps=2)
    run_workers(_peer_worker, 4, job, timeout_s=170)


def test_metadata_table_rows():
    rows = metadata_table([
        {"layer": 2, "index": 1, "bytes": 10, "policy": "peer", "chunks": [[1, 6], [3, 4]]},
        {"layer": 1, "index": 0, "bytes": 8, "policy": "keep", "chunks": []},
        {"layer": 1, "index": 3, "bytes": 8, "policy": "peer", "chunks": [[2, 8]]},
    ], {1: 11, 2: 12, 3: 13})
    assert rows == [TensorMeta(1, 3, 8, (ChunkMeta(12, 8),)),
                    TensorMeta(2, 1, 10, (ChunkMeta(11, 6), ChunkMeta(13, 4)))]
    assert [r.n_chunks for r in rows] == [1, 2]
    with pytest.raises(ValueError, match="do not add up"):
        metadata_table([{"layer": 0, "index": 0, "bytes": 10, "policy": "peer",
                         "chunks": [[1, 6], [-1, 4]]}], {1: 1})
