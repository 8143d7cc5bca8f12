"""Node identity under torchrun: hierarchical sync's nodes and the token ring's node count
come from torchrun's environment; and a token ring under a real ``torchrun --standalone``
on this host, meeting at the rendezvous published through torchrun's store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from trainwright.config import load_config
from trainwright.errors import ConfigError
from trainwright.run.reference import train_reference
from trainwright.run.ring_torchrun import torchrun_config
from trainwright.sync.hier_layout import node_key, node_layout


@pytest.mark.timeout(30)
def test_node_key_follows_torchrun_group_rank():
    import socket

    assert node_key({}) == socket.gethostname()
    env = {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert node_key(env) == "torchrun-node-1"
    assert node_key({**env, "TRAINWRIGHT_HOST": "h7"}) == "h7"
    # 4 ranks, 2 per torchrun node (same host name): stage 0's replicas are ranks 0 and 2
    hosts = [node_key({"GROUP_RANK": str(r // 2), "LOCAL_WORLD_SIZE": "2"}) for r in range(4)]
    lay = node_layout([0, 2], 0, hosts)
    assert lay.nodes == 2 and lay.ranks_per_node == 1


@pytest.mark.timeout(30)
def test_torchrun_ring_has_one_node_per_process(tmp_path):
    base = ["sync.strategy=tokenring", "model.name=mlp", "train.batch_size=32",
            f"run.dir='{tmp_path}'"]
    cfg = torchrun_config(load_config(None, base), 8)
    assert cfg.tokenring.nodes == 8
    with pytest.raises(ConfigError, match="WORLD_SIZE = 6.*train.batch_size = 32"):
        torchrun_config(load_config(None, base), 6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_token_ring_under_torchrun_standalone(tmp_path):
    """Two processes of ``torchrun --standalone``: each is a ring node; with no
    ``tokenring.rendezvous`` rank 0 publishes one through torchrun's store."""
    keys = {"sync.strategy": "tokenring", "model.name": "mlp", "model.d_in": 16,
            "model.d_model": 32, "model.n_blocks": 2, "train.batch_size": 32,
            "train.steps": 3, "train.optimizer": "adam", "train.lr": 0.01,
            "tokenring.close_fraction": 1.0, "tokenring.token_timeout_s": 1.0,
            "run.dir": f"'{tmp_path / 'runs'}'", "run.name": "ring"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "trainwright.cli", "run",
           *[x for k, v in keys.items() for x in ("--set", f"{k}={v}")]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = tmp_path / "runs" / "ring"
    assert f"run directory: {run_dir}" in res.stdout
    reps = [json.loads((run_dir / f"node{i}.json").read_text()) for i in range(2)]
    assert all(r["members"] == [0, 1] and r["contributed"] == [1, 2, 3] for r in reps)
    cfg = load_config(run_dir / "config.toml")
    assert cfg.tokenring.nodes == 2
    model, _ = train_reference(cfg)
    torch.testing.assert_close(torch.load(run_dir / "model.pt"), model.state_dict())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_node_under_torchrun_is_ended_and_torchrun_returns(tmp_path):
    """Node 2 of 3 freezes (SIGSTOP) in step 2: the ring drops it and finishes; a node on
    the same machine ends the frozen process, so torchrun returns instead of waiting for it
    (and reports that rank as failed: it was killed)."""
    keys = {"sync.strategy": "tokenring", "model.name": "mlp", "model.d_in": 16,
            "model.d_model": 32, "model.n_blocks": 2, "train.batch_size": 30,
            "train.steps": 8, "train.optimizer": "adamw", "train.lr": 0.01,
            "tokenring.close_fraction": 0.6, "tokenring.token_timeout_s": 0.5,
            "tokenring.succession_s": 0.3, "tokenring.kill_nodes": "[2]",
            "tokenring.kill_step": 2, "tokenring.kill_signal": "SIGSTOP",
            "run.dir": f"'{tmp_path / 'runs'}'", "run.name": "frozen"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "3", "-m", "trainwright.cli", "run",
           *[x for k, v in keys.items() for x in ("--set", f"{k}={v}")]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = res.stdout + res.stderr
    assert "node 2 was dropped by the ring and was still running" in out, out[-3000:]
    assert res.returncode != 0  # torchrun reports the SIGKILLed rank
    run_dir = tmp_path / "runs" / "frozen"
    reps = [json.loads((run_dir / f"node{i}.json").read_text()) for i in range(2)]
    assert all(r["status"] == "done" and r["members"] == [0, 1] for r in reps)
    assert reps[0]["hashes"] == reps[1]["hashes"] and len(reps[0]["hashes"]) == 8
    assert (run_dir / "model.pt").exists()


@pytest.mark.timeout(30)
def test_torchrun_ring_config_is_validated_with_world_size_nodes(tmp_path, monkeypatch):
    from trainwright.run.ring_torchrun import load_torchrun_config

    monkeypatch.setenv("WORLD_SIZE", "3")
    ring = ["sync.strategy=tokenring", "model.name=mlp", "train.batch_size=30"]
    assert load_torchrun_config(None, ring).tokenring.nodes == 3  # 30 % 4 would fail
    with pytest.raises(ConfigError, match="WORLD_SIZE = 3: train.batch_size = 32"):
        load_torchrun_config(None, [*ring[:2], "train.batch_size=32"])
    dense = load_torchrun_config(None, ["train.batch_size=30", "train.micro_batches=3"])
    assert dense.tokenring.nodes == 4  # other strategies: loaded as written
