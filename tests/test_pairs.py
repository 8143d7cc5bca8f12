"""Pairs of docs/combinations.md that no test of their own trains, several per run.

Every run is pp = 2 x dp = 2 (four gloo ranks) and is compared with the plain-torch
reference of ``tests/torch_reference.py`` (which applies ``rebalance.edits`` as the trainer
does, and autocast / clipping / lr schedules / evaluation), or, for a resume, bit for bit
with the uninterrupted run (which is itself compared with the reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_bitwise, resume_pair, run_recording_sparse, step_rows
from tests.torch_reference import check_against_torch
from trainwright.config import Config
from trainwright.run.launch import create_run_dir

BASE = {"parallel.pp": 2, "parallel.dp": 2, "train.micro_batches": 2, "train.steps": 4,
        "runtime.p2p_timeout_s": 60.0}  # a hang fails in a minute, not five
EDITS = {"rebalance.edits": '"tests.factories:insert_heavy"', "train.momentum": 0.9}
SPARSE = {"sync.sparse": "true", "sync.sparse_path": '"allgather"'}
HIER = {"sync.strategy": '"hierarchical"', "hierarchical.ranks_per_node": 1,
        "hierarchical.align": 16}
OPTIONS = {"train.clip_norm": 0.3, "train.lr_schedule": '"cosine"', "train.warmup_steps": 0,
           "eval.every": 2}
BF16 = {"train.precision": '"bf16"'}
TIED = {"model.factory": '"tests.hf_models:tied_sequential"', "model.context": 8}
"""embedding and head share one parameter (layers 0 and 4 of 6, on stages 0 and 1)"""
BF16_TOL = {"loss_rtol": 1e-3, "param_tol": 2e-2}  # as test_bf16_with_recompute_...


def _resume_pair(root: Path, **kw) -> tuple[tuple, list]:
    """:func:`tests.helpers.resume_pair` stopped after step 2 of BASE's 4."""
    return resume_pair(root, 2, **{**BASE, "train.momentum": 0.9, **kw})


def _peer_limits(keep_dir: Path, share: float = 0.6) -> str:
    """``memory.limit`` per stage: stage 0 gets ``share`` of what keeping needs, stage 1 room
    for all of stage 0's activations besides its own (as in test_peerswap)."""
    peaks = [st["activation_peak_bytes"] for st in step_rows(keep_dir)[-1]["stages"]]
    return json.dumps([int(share * peaks[0]), peaks[1] + peaks[0]])


def _lent(run_dir: Path) -> int:
    """Tensors stage 0 sends to a peer in the plan the run wrote."""
    plan = json.loads((run_dir / "peer_plan.json").read_text())
    return plan["policy_counts"][0].get("peer", 0)


def _check_all(runs: dict[str, Config], dirs: dict[str, Path]) -> None:
    """Each run equal to the reference (bf16 within its tolerance); peer-swap runs lent."""
    for label, cfg in runs.items():
        try:
            check_against_torch(cfg, dirs[label],
                                **(BF16_TOL if cfg.train.precision == "bf16" else {}))
            if cfg.memory.peer_swap:
                assert _lent(dirs[label]) > 0, "stage 0 lent nothing to its peer"
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc


def _with_resumes(runs: dict, dirs: dict, resumes: dict) -> None:
    """Resumed runs bit for bit equal to their uninterrupted runs, which join ``runs``."""
    for label, ((full, d_full, d_cut), _) in resumes.items():
        assert_bitwise(d_full, d_cut, label)
        runs[label], dirs[label] = full, d_full


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_more_pairs_equal_the_reference(tiny, tmp_path):
    """G x E, R x E, S x E, E x D, E x Sp, S x Sp, R x H, ZB x Sp, ZB x H; resumes G x Re,
    R x Re, S x Re, ZB x Re; precision / clipping / evaluation with swap, recompute and
    edits; tied weights with swap, sparse sync and resume."""
    runs = {
        "gpipe edits recompute dense clip": tiny(**BASE, **EDITS, **{
            "train.schedule": '"gpipe"', "memory.policies": '["recompute"]',
            "train.clip_norm": 0.3}),
        "bf16 edits swap sparse eval": tiny(**BASE, **EDITS, **SPARSE, **BF16, **{
            "memory.policies": '["swap"]', "eval.every": 2}),
        "bf16 swap recompute hierarchical": tiny(**BASE, **HIER, **BF16, **{
            "memory.policies": '["swap", "recompute", "recompute", "swap"]'}),
        "zb-h2 hierarchical": tiny(**BASE, **HIER, **{"train.schedule": '"zb-h2"'}),
        "tied swap sparse": tiny(**BASE, **TIED, **SPARSE, **{"memory.policies": '["swap"]'}),
    }
    dirs = {k: create_run_dir(c) for k, c in runs.items()}
    resumes = {  # label: ((full config, uninterrupted dir, resumed dir), jobs)
        "gpipe swap recompute": _resume_pair(tmp_path / "r1", **{
            "train.schedule": '"gpipe"',
            "memory.policies": '["swap", "recompute", "keep", "swap"]'}),
        "zb-h1 sparse": _resume_pair(tmp_path / "r2", **SPARSE, **{
            "train.schedule": '"zb-h1"'}),
        "tied": _resume_pair(tmp_path / "r3", **TIED),
    }
    run_recording_sparse(tmp_path, [(c, dirs[k], False) for k, c in runs.items()]
         + [j for _, more in resumes.values() for j in more], 600)
    _with_resumes(runs, dirs, resumes)
    _check_all(runs, dirs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peer_swap_pairs_equal_the_reference(tiny, tmp_path):
    """G x P, P x D, P x H, P x Sp, P x Re; peer swap with clipping, cosine lr and
    evaluation; tied weights with peer swap. GPipe: with two micro-batches the 1F1B plan
    has no time to lend. Limits from a run that keeps everything; a slow host link (as
    next to NVLink) so that the planner lends to the peer rather than swapping to the host."""
    keep = {"gpt": tiny(**BASE, **{"train.schedule": '"gpipe"'}),
            "tied": tiny(**BASE, **TIED, **{"train.schedule": '"gpipe"'})}
    keep_dirs = {k: create_run_dir(c) for k, c in keep.items()}
    run_recording_sparse(tmp_path, [(c, keep_dirs[k], False) for k, c in keep.items()], 300)
    peer = {"memory.peer_swap": "true", "memory.limit": _peer_limits(keep_dirs["gpt"]),
            "train.schedule": '"gpipe"', "memory.peer_bandwidth": 1e11,
            "memory.host_bandwidth": 1e4}
    runs = {
        "peer dense options": tiny(**BASE, **peer, **OPTIONS),
        "peer hierarchical": tiny(**BASE, **peer, **HIER),
        "tied peer": tiny(**BASE, **TIED, **{**peer, "memory.limit": _peer_limits(
            keep_dirs["tied"], 0.8)}),  # the small model's tensors: fewer ways to split
    }
    dirs = {k: create_run_dir(c) for k, c in runs.items()}
    resumes = {"peer sparse": _resume_pair(tmp_path / "r1", **peer, **SPARSE)}
    run_recording_sparse(tmp_path, [(c, dirs[k], False) for k, c in runs.items()]
         + resumes["peer sparse"][1], 600)
    _with_resumes(runs, dirs, resumes)
    _check_all(runs, dirs)


@pytest.mark.timeout(240)
def test_ring_nodes_recompute_and_swap_as_configured(tmp_path):
    """R x T, S x T: each ring node is a one-stage trainer, and ``memory.policies`` apply to
    its layers (the store of the node's trainer holds them); trained with recompute and swap,
    the ring equals the single-process reference."""
    from tests.helpers import ring_cfg, run_ring
    from trainwright.dist.topology import Topology
    from trainwright.model.build import build_layers
    from trainwright.run.reference import train_reference
    from trainwright.run.ring_node import _node_config
    from trainwright.run.trainer import Trainer, TrainerOptions
    from trainwright.tokenring.exchange import RingExchange

    probe = ring_cfg(tmp_path, **{"tokenring.nodes": 2})
    mix = ["recompute", "swap"] * len(build_layers(probe))
    mix = mix[:len(build_layers(probe))]
    cfg = ring_cfg(tmp_path, **{"tokenring.nodes": 2, "train.steps": 4,
                                "memory.policies": json.dumps(mix)})
    node = Trainer(_node_config(cfg), tmp_path / "probe", options=TrainerOptions(
        mesh=Topology(pp=1, dp=1, rank=0), outputs=False,
        grad_sync=RingExchange(cfg.tokenring, 0, False, on_applied=print),
    ))  # as RingNode builds it, without joining a ring
    assert node.stage.store.policies == dict(enumerate(mix))
    result = run_ring(cfg)
    assert result.ok, result.message()
    model, _ = train_reference(cfg)
    torch.testing.assert_close(torch.load(result.run_dir / "model.pt"), model.state_dict())


@pytest.mark.timeout(240)
def test_ring_trains_a_tied_model_like_the_reference(tmp_path):
    """Tied weights x T: every ring node holds the whole model, so the shared weight is one
    parameter, stepped once; the ring equals the single-process reference. A node that
    fails names its error (the launcher used to report only an exit code)."""
    from tests.helpers import ring_cfg, run_ring
    from trainwright.run.reference import train_reference

    tied = {"tokenring.nodes": 2, "train.steps": 3, "model.name": '"gpt"', "model.d_model": 16,
            "data.name": '"synthetic"', **TIED}
    result = run_ring(ring_cfg(tmp_path / "ok", **tied))
    assert result.ok, result.message()
    model, _ = train_reference(ring_cfg(tmp_path / "ok", **tied))
    torch.testing.assert_close(torch.load(result.run_dir / "model.pt"), model.state_dict())
    # the same model on the MLP's float vectors: the embedding refuses them, and says so
    bad = run_ring(ring_cfg(tmp_path / "bad", **{**tied, "model.name": '"mlp"'}))
    assert not bad.ok and "RuntimeError: Expected tensor for argument" in bad.message(), \
        bad.message()


def _torchrun(*args: str) -> Path:
    """``torchrun --nproc-per-node 4 -m trainwright.cli run ARGS``; the run directory."""
    import subprocess
    import sys

    from tests.helpers import run_dir_from_stdout
    from trainwright.dist.ports import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "4", "--master-port", str(free_port()), "-m", "trainwright.cli",
                           "run", *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir_from_stdout(proc.stdout)


def _sets(tmp_path: Path, **kw) -> list[str]:
    from tests.conftest import tiny_overrides

    return [x for s in tiny_overrides(tmp_path / "runs", **{**BASE, **kw})
            for x in ("--set", s)]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_torchrun_jobs_with_many_features_equal_the_reference(tmp_path):
    """Under ``torchrun --nproc-per-node 4`` (pp = 2 x dp = 2), each equal to the reference:
    GPipe + recompute / swap / keep + sparse sync + a live migration + clipping, cosine lr and
    evaluation; 1F1B + a model edit + the same options; ZB-H1 + hierarchical sync + bf16,
    stopped after step 2 and resumed under torchrun to step 4; tied weights with swap."""
    many = _torchrun(*_sets(tmp_path, **SPARSE, **OPTIONS, **{
        "train.schedule": '"gpipe"',
        "memory.policies": '["recompute", "swap", "keep", "recompute"]',
        "rebalance.at_step": 2, "rebalance.to": "[1, 3]"}))
    edited = _torchrun(*_sets(tmp_path, **EDITS, **OPTIONS))
    zb = _torchrun(*_sets(tmp_path, **HIER, **BF16, **{"train.schedule": '"zb-h1"',
                                                       "train.steps": 2}))
    assert _torchrun("--resume", str(zb), "--set", "train.steps=4") == zb
    tied = _torchrun(*_sets(tmp_path, **TIED, **{"memory.policies": '["swap"]'}))
    _check_runs(many, edited, zb, tied)
    assert [r["step"] for r in step_rows(zb)] == [1, 2, 3, 4]
    assert [r["step"] for r in step_rows(edited)] == [1, 2, 3, 4]
    moves = [json.loads(x) for x in (many / "metrics.jsonl").read_text().splitlines()]
    assert [r["new"] for r in moves if r["kind"] == "repartition"] == [[1, 3]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_interleaved_pairs_equal_the_reference(tiny, tmp_path):
    """IL x Sp, IL x H (pp = 2 x dp = 2, two chunks per rank; with clipping and a cosine lr,
    and with bf16) and IL x Tr (ZB-V with hierarchical sync, interleaved 1F1B with sparse
    sync, under ``torchrun --nproc-per-node 4``), each equal to the reference."""
    il = {"train.schedule": '"interleaved-1f1b"', "parallel.virtual_stages": 2}
    zbv = {"train.schedule": '"zb-v"', "parallel.virtual_stages": 2}
    clip_cosine = {k: v for k, v in OPTIONS.items() if k != "eval.every"}  # eval: refused
    runs = {"interleaved sparse clip cosine": tiny(**BASE, **SPARSE, **il, **clip_cosine),
            "zb-v hierarchical bf16": tiny(**BASE, **HIER, **zbv, **BF16)}
    dirs = {k: create_run_dir(c) for k, c in runs.items()}
    run_recording_sparse(tmp_path, [(c, dirs[k], False) for k, c in runs.items()], 600)
    _check_all(runs, dirs)
    _check_runs(_torchrun(*_sets(tmp_path, **HIER, **zbv)),
                _torchrun(*_sets(tmp_path, **SPARSE, **il)))


def _check_runs(*run_dirs: Path) -> None:
    """:func:`_check_all` of run directories, each with its saved config."""
    from trainwright.config import load_config

    _check_all({str(d): load_config(d / "config.toml") for d in run_dirs},
               {str(d): d for d in run_dirs})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peer_swap_under_torchrun_equals_the_reference(tmp_path):
    """P x Tr: a GPipe run keeping everything gives the limits; peer swap under them (stage
    0 lends to stage 1) under ``torchrun --nproc-per-node 4`` equals the reference."""
    keep = _torchrun(*_sets(tmp_path, **{"train.schedule": '"gpipe"'}))
    peer = _torchrun(*_sets(tmp_path, **{"memory.peer_swap": "true",
                                         "memory.limit": _peer_limits(keep),
                                         "train.schedule": '"gpipe"',
                                         "memory.peer_bandwidth": 1e11,
                                         "memory.host_bandwidth": 1e4}))
    _check_runs(keep, peer)
