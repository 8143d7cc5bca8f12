"""Sync strategies follow live migration; checkpoints hold all state (issue 18, items 1-2).

* hierarchical and sparse sync with a live migration equal the single-process reference;
* a resumed run equals the uninterrupted one bit for bit (dense, sparse, hierarchical
  AdamW, after a migration);
* a run saved at pp=2 x dp=2 resumes at pp=4 x dp=1.

Each test spawns one group of four gloo ranks and runs its jobs one after another in it
(process start-up dominates on small machines).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import (
    assert_bitwise,
    check_against_reference,
    resume_pair,
    run_recording_sparse,
    step_rows,
    tiny_config,
)
from trainwright.config import Config, load_config
from trainwright.run import checkpoint
from trainwright.run.api import load_model
from trainwright.run.launch import create_run_dir
from trainwright.run.reference import train_reference

MLP_ADAMW = {"model.name": '"mlp"', "model.n_blocks": 3, "train.optimizer": '"adamw"',
             "train.lr": 0.01, "train.weight_decay": 0.1, "train.micro_batches": 2}
HIER = {"sync.strategy": '"hierarchical"', "hierarchical.ranks_per_node": 2,
        "hierarchical.weights": "[2, 1]", "hierarchical.align": 16,
        "hierarchical.chunks": 2}
SPARSE = {"model.factory": '"tests.factories:token_model"', "sync.sparse": "true",
          "sync.sparse_path": '"allgather"', "train.micro_batches": 2}
PP2DP2 = {"parallel.pp": 2, "parallel.dp": 2}


@pytest.mark.timeout(480)
def test_hierarchical_and_sparse_sync_follow_a_live_migration(tmp_path):
    mig = {"rebalance.at_step": 2, "train.steps": 4, **PP2DP2}
    hier_adamw = tiny_config(tmp_path, **MLP_ADAMW, **HIER, **mig, **{"rebalance.to": "[1, 3]"})
    hier_2nodes = tiny_config(tmp_path, **{**HIER, **mig,  # GPT, 2 nodes x 1, layers move back
        "hierarchical.ranks_per_node": 1, "hierarchical.weights": '"equal"',
        "train.optimizer": '"sgd"', "train.momentum": 0.9, "train.micro_batches": 2,
        "parallel.partition": "[1, 3]", "rebalance.to": "[3, 1]"})
    sparse = tiny_config(tmp_path, **SPARSE, **mig, **{"rebalance.to": "[1, 4]"})
    # a model edit (a layer inserted into stage 0 before step 3): hierarchical vs dense sync
    edit = {**PP2DP2, "train.steps": 6, "train.micro_batches": 2, "train.momentum": 0.9,
            "rebalance.edits": '"tests.factories:insert_heavy"'}
    edits = [tiny_config(tmp_path, **edit), tiny_config(tmp_path, **HIER, **edit)]
    cfgs = [hier_adamw, hier_2nodes, sparse]
    dirs = [create_run_dir(c) for c in cfgs + edits]
    seen = run_recording_sparse(
        tmp_path, [(c, d, False) for c, d in zip(cfgs + edits, dirs, strict=True)], 460)
    dense_losses, hier_losses = ([r["loss"] for r in step_rows(d)] for d in dirs[3:])
    assert len(hier_losses) == 6
    torch.testing.assert_close(torch.tensor(hier_losses), torch.tensor(dense_losses))
    for cfg, run_dir in zip(cfgs, dirs[:3], strict=True):
        reps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        reps = [r for r in reps if r["kind"] == "repartition"]
        assert reps and reps[-1]["new"] == cfg.rebalance.to, reps
        check_against_reference(cfg, run_dir)
    # the position table moved to stage 1 in step 2: from that step's SYNC on, stage 1 sends
    # it row-sparse (stage 0 keeps the token table, synced sparse every step)
    for rank in range(4):
        want = [1, 2, 3, 4] if rank % 2 == 0 else [2, 3, 4]
        assert seen[rank]["2"] == want, (rank, seen[rank])


@pytest.mark.timeout(600)
def test_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    cases = {
        "dense adamw": dict(**MLP_ADAMW, **PP2DP2, **{"train.steps": 3}),
        "sparse": dict(**SPARSE, **PP2DP2, **{"train.steps": 3}),
        "hierarchical adamw": dict(**MLP_ADAMW, **HIER, **PP2DP2, **{"train.steps": 3}),
        "after a migration": dict(**MLP_ADAMW, **HIER, **PP2DP2, **{
            "train.steps": 4, "rebalance.at_step": 2, "rebalance.to": "[1, 3]"}),
    }
    jobs, checks = [], []
    for label, kw in cases.items():
        stop = 3 if "rebalance.at_step" in kw else 2
        (full, d_full, d_cut), more = resume_pair(tmp_path / label.replace(" ", "_"), stop, **kw)
        jobs += more
        checks.append((label, full, d_full, d_cut, stop))
    run_recording_sparse(tmp_path, jobs, 580)
    for label, full, d_full, d_cut, stop in checks:
        assert_bitwise(d_full, d_cut, label)
        if full.rebalance.at_step:  # resumed at the partition the migration reached
            assert checkpoint.read_meta(d_cut, stop)["partition"] == [1, 3]
            runs = [json.loads(x) for x in (d_cut / "metrics.jsonl").read_text().splitlines()]
            runs = [r for r in runs if r["kind"] == "run"]
            assert [len(p) for p in runs[-1]["partition"]] == [1, 3], runs[-1]["partition"]
    # the hierarchical checkpoint holds every Adam moment, in per-parameter form
    got = load_model(checks[2][3])
    assert sum(p.numel() for p in got.parameters()) > 0
    meta = torch.distributed.checkpoint.FileSystemReader(
        d := checks[2][3] / "checkpoints" / "step_000003").read_metadata().state_dict_metadata
    for i, layer in enumerate(got):
        for name, p in layer.named_parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert f"optim.layer{i}.{name}.{key}" in meta, (d, i, name, key)
            assert tuple(meta[f"optim.layer{i}.{name}.exp_avg"].size) == tuple(p.shape)


@pytest.mark.timeout(480)
def test_resume_at_another_pipeline_and_replica_count(tmp_path):
    # saved with hierarchical sync at pp=2 x dp=2 (sharded Adam state), resumed with dense
    # sync at pp=4 x dp=1: each stage takes its layers' entries by name
    kw = dict(**MLP_ADAMW, **HIER, **PP2DP2, **{"train.steps": 4})
    other = {"parallel.pp": 4, "parallel.dp": 1, "sync.strategy": '"dense"'}
    (full, d_full, d_cut), jobs = resume_pair(tmp_path, 2, resume_cfg=other, **kw)
    run_recording_sparse(tmp_path, jobs[1:], 460)
    resumed = load_config(d_cut / "config.toml")
    assert (resumed.parallel.pp, resumed.parallel.dp) == (4, 1)
    check_against_reference(resumed, d_cut)
    # and the optimizer state really came along: without it, steps 3-4 differ
    ref, _ = train_reference(resumed)
    fresh = _restart_without_optimizer_state(resumed)
    gap = max((a - b).abs().max().item() for a, b in
              zip(ref.parameters(), fresh.parameters(), strict=True))
    assert gap > 1e-4, gap


def _restart_without_optimizer_state(cfg: Config) -> torch.nn.Module:
    """Reference for steps 1-2, then a fresh optimizer for steps 3-4 (what a resume that
    lost the Adam moments would compute)."""
    from trainwright.model.build import build_data, build_optimizer, loss_fn

    model, _ = train_reference(cfg, steps=2)
    opt = build_optimizer(cfg, list(model.parameters()))
    data, criterion = build_data(cfg), loss_fn(cfg)
    for step in (3, 4):
        x, y = data.batch(step, cfg.train.batch_size)
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()
    return model


def test_checkpoint_round_trips_layers_registered_objects_and_rng(tmp_path):
    """One process: what a checkpoint holds comes back (an LR scheduler registered as an
    extra object, the RNG states), and a missing layer is named."""
    from trainwright.model.build import build_layers, build_optimizer
    from trainwright.pipeline.stage import LayerSlot

    cfg = tiny_config(tmp_path, **MLP_ADAMW)

    def stage():
        slots = [LayerSlot(i, n, m, build_optimizer(cfg, list(m.parameters())))
                 for i, (n, m) in enumerate(build_layers(cfg))]
        sched = torch.optim.lr_scheduler.StepLR(slots[0].optimizer, step_size=1, gamma=0.5)
        return slots, sched

    slots, sched = stage()
    for s in slots:
        for p in s.module.parameters():
            p.grad = torch.randn_like(p)
        s.optimizer.step()
    sched.step()
    objects = {"lr_scheduler": (sched, False)}
    torch.manual_seed(123)
    state = {**checkpoint.layer_state(slots), **checkpoint.rng_state(0),
             **checkpoint.extra_state(objects, 0)}
    checkpoint.save(tmp_path, 7, state)
    checkpoint.write_meta(tmp_path, 7, dict(pp=1, dp=1, partition=[len(slots)]))
    expected_draw = torch.rand(3)

    torch.manual_seed(999)
    fresh, fresh_sched = stage()
    missing = checkpoint.load_state(tmp_path, 7, fresh, rank=0, mesh=(1, 1),
                                    objects={"lr_scheduler": (fresh_sched, False)})
    assert missing == []
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh[0].optimizer.param_groups[0]["lr"] == sched.get_last_lr()[0]
    for a, b in zip(slots, fresh, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            sa, sb = a.optimizer.state[p], b.optimizer.state[q]
            assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for k in sa:
                torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    # at another mesh the RNG states stay as they are, and the caller is told
    assert checkpoint.load_state(tmp_path, 7, fresh, rank=0, mesh=(2, 1)) == ["rng"]
    extra = LayerSlot(len(slots), "extra", torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match=f"no model.layer{len(slots)}.weight"):
        checkpoint.load_state(tmp_path, 7, [extra])
