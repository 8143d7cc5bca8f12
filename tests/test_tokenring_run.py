"""Token ring as a full training mode: any optimizer, checkpoints and ``--resume``,
``trainwright.fit``, and a frozen node that must not keep the command waiting.

Real node processes on 127.0.0.1 (pyzmq, no process group), compared with the
single-process reference (:func:`trainwright.run.reference.train_reference`) or with the
uninterrupted run.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.helpers import RING_TIMEOUTS, assert_identical_replicas, ring_cfg, run_ring
from trainwright.run.reference import train_reference

ADAMW = {"train.optimizer": '"adamw"', "train.lr": 0.01, "train.weight_decay": 0.05}


def ring_keys(tmp_path, name: str, **extra) -> list[str]:
    """``section.key=value`` overrides of a small AdamW ring (2 nodes unless told)."""
    keys = {"sync.strategy": "tokenring", "model.name": "mlp", "model.d_in": 16,
            "model.d_model": 32, "model.n_blocks": 2, "train.batch_size": 32,
            "train.lr": 0.01, "train.weight_decay": 0.05, "train.optimizer": "adamw",
            "tokenring.nodes": 2, "tokenring.close_fraction": 1.0,
            **RING_TIMEOUTS,
            "tokenring.formation_quiet_s": 10.0, "run.dir": f"'{tmp_path / 'runs'}'",
            "run.name": name, **extra}
    return [f"{k}={v}" for k, v in keys.items()]


def ring_argv(tmp_path, name: str, **extra) -> list[str]:
    """``trainwright run --set ...`` of :func:`ring_keys`."""
    return ["run"] + [x for kv in ring_keys(tmp_path, name, **extra) for x in ("--set", kv)]


@pytest.mark.timeout(150)
def test_adamw_ring_equals_single_process_adamw(tmp_path):
    """Every contribution arrives (close_fraction 1): sum / n is the full batch's gradient,
    and the layers' AdamW steps as one AdamW over the whole model would."""
    cfg = ring_cfg(tmp_path, **ADAMW, **{"train.steps": 4})
    result = run_ring(cfg)
    assert result.ok, result.message()
    reps = result.reports
    assert all(r["contributed"] == [1, 2, 3, 4] for r in reps.values())
    assert_identical_replicas(reps, range(1, 5))
    model, _ = train_reference(cfg)
    saved = torch.load(result.run_dir / "model.pt")
    torch.testing.assert_close(saved, model.state_dict())
    # AdamW is not SGD: the same weights after plain SGD would differ
    sgd = ring_cfg(tmp_path, **{"train.optimizer": '"sgd"', "train.lr": 0.01, "train.steps": 4})
    sgd_model, _ = train_reference(sgd)
    assert not torch.allclose(next(iter(saved.values())),
                              next(iter(sgd_model.state_dict().values())))


@pytest.mark.timeout(150)
def test_fit_with_the_ring_trains_and_load_model_reads_it(tmp_path):
    import trainwright

    run_dir = trainwright.fit(overrides=ring_keys(tmp_path, "fit", **{"train.steps": 5}))
    cfg = ring_cfg(tmp_path, **ADAMW, **{"train.steps": 5, "tokenring.nodes": 2})
    model, _ = train_reference(cfg)
    loaded = trainwright.load_model(run_dir)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
    torch.testing.assert_close(torch.load(run_dir / "model.pt"), model.state_dict())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "5"


@pytest.mark.timeout(150)
def test_ring_resume_equals_the_uninterrupted_run(tmp_path):
    """3 steps, then ``--resume`` to 6: node 0 loads the checkpoint (weights and AdamW
    moments) and welcomes node 1 with both; the result is the 6-step run bit for bit."""
    from trainwright.cli import main

    assert main(ring_argv(tmp_path, "whole", **{"train.steps": 6})) == 0
    assert main(ring_argv(tmp_path, "cut", **{"train.steps": 3})) == 0
    cut = tmp_path / "runs" / "cut"
    assert (cut / "checkpoints" / "latest").read_text().strip() == "3"
    assert main(["run", "--resume", str(cut), "--set", "train.steps=6"]) == 0
    whole = torch.load(tmp_path / "runs" / "whole" / "model.pt")
    resumed = torch.load(cut / "model.pt")
    assert whole.keys() == resumed.keys()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    reps = {k: json.loads((cut / f"node{k}.json").read_text()) for k in (0, 1)}
    assert sorted(map(int, reps[1]["hashes"])) == [4, 5, 6]  # the resumed run's steps
    assert reps[1]["joined"][0]["applied"] == 3
    assert_identical_replicas(reps, range(4, 7))
    full = {k: json.loads((tmp_path / "runs" / "whole" / f"node{k}.json").read_text())
            for k in (0, 1)}
    assert all(full[0]["hashes"][str(s)] == reps[0]["hashes"][str(s)] for s in (4, 5, 6))


@pytest.mark.timeout(120)
def test_frozen_node_is_dropped_ended_and_the_command_exits(tmp_path, capfd):
    """Node 2 freezes (SIGSTOP, as a hung host) in step 3: the ring drops it and finishes;
    the launcher ends the frozen process and the command exits, naming it."""
    from trainwright.cli import main

    # longer timeouts than RING_TIMEOUTS: with 4 nodes on 2 busy cores (the full suite) a
    # live node went 0.5 s unscheduled and was dropped as well (seen in CI)
    argv = ring_argv(tmp_path, "frozen", **{
        "tokenring.nodes": 4, "train.steps": 12, "tokenring.close_fraction": 0.75,
        "tokenring.kill_nodes": "[2]", "tokenring.kill_step": 3,
        "tokenring.kill_signal": "SIGSTOP",
        "tokenring.token_timeout_s": 2.0, "tokenring.succession_s": 1.0})
    t0 = time.monotonic()
    assert main(argv) == 0
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "warning: node 2 was dropped by the ring" in err and "ended it with SIGKILL" in err
    run_dir = tmp_path / "runs" / "frozen"
    assert not (run_dir / "node2.json").exists()  # it never ran again
    reps = {k: json.loads((run_dir / f"node{k}.json").read_text()) for k in (0, 1, 3)}
    assert all(r["status"] == "done" and r["members"] == [0, 1, 3] for r in reps.values())
    lost = [e for r in reps.values() for e in r["events"] if e["event"] == "lost"]
    assert [e["node"] for e in lost] == [2]
    assert_identical_replicas(reps, range(1, 13))
    closes = {int(s): c for s, c in reps[0]["closes"].items()}
    assert all(2 not in closes[s] for s in range(4, 13))
    assert took < 100, f"the command took {took:.0f} s"


@pytest.mark.timeout(180)
def test_rejoined_node_gets_the_adamw_state_and_stays_identical(tmp_path):
    """A node killed in step 3 and restarted is admitted at a batch boundary: its welcome
    carries the weights and the AdamW moments, so its updates match the others' bit for bit."""
    cfg = ring_cfg(tmp_path, **ADAMW, **{
        "tokenring.close_fraction": 0.75, "tokenring.kill_nodes": [2],
        "tokenring.kill_step": 3, "tokenring.restart_killed": "true",
        "tokenring.batch_steps": 4, "train.steps": 40,
        # steps of at least 0.2 s leave the restarted process time to arrive on a busy host
        "tokenring.pace_s": 0.2})
    result = run_ring(cfg, timeout_s=100)
    assert result.ok, result.message()
    reps = result.reports
    assert "2r" in reps, f"the restarted node never joined: {result.message()}"
    b = reps["2r"]["joined"][0]["applied"]
    assert b % 4 == 0 and 4 <= b < 40
    assert sorted(int(s) for s in reps["2r"]["hashes"]) == list(range(b + 1, 41))
    assert_identical_replicas(reps, range(1, 41))
