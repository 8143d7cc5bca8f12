"""Peer pipeline systems train exactly the benchmark workload: same losses, same weights."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainwright.bench.deepspeed_peer import deepspeed_available, deepspeed_worker
from trainwright.bench.peers import spawn_peer, step_time_s, torch_pipelining_worker
from trainwright.bench.spec import PipelineBenchSpec


def tiny_spec() -> PipelineBenchSpec:
    """A workload small enough to train in a second."""
    return PipelineBenchSpec(
        n_blocks=2,
        d_model=32,
        n_heads=2,
        context=16,
        micro_batches=4,
        micro_batch_size=2,
        split=[2, 2],
        steps=3,
    )


def reference(spec: PipelineBenchSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: each micro-batch's mean loss scaled by 1/micro_batches."""
    model = nn.Sequential(*spec.layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    data = spec.data()
    losses: list[float] = []
    for step in range(spec.steps):
        ids, targets = data.batch(step + 1, spec.batch_size)
        optimizer.zero_grad()
        total = torch.zeros(())
        for mb_ids, mb_targets in zip(
            ids.chunk(spec.micro_batches), targets.chunk(spec.micro_batches), strict=True
        ):
            logits = model(mb_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), mb_targets.flatten())
            scaled = loss / spec.micro_batches
            scaled.backward()
            total += scaled.detach()
        optimizer.step()
        losses.append(total.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_against_reference(results: list[dict], spec: PipelineBenchSpec, system: str) -> None:
    """Losses, parameters and checksums of a peer run equal the single-process reference."""
    ref_losses, ref_state = reference(spec)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["system"] == system for r in results)
    assert results[0]["losses"] is None
    assert all(len(r["step_times_s"]) == spec.steps for r in results)
    assert all(t > 0 for r in results for t in r["step_times_s"])
    torch.testing.assert_close(
        torch.tensor(results[-1]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
    )
    state: dict[str, torch.Tensor] = {}
    for r in results:
        assert not state.keys() & r["state"].keys()
        state.update(r["state"])
        ref_sum = sum(ref_state[k].double().sum().item() for k in r["state"])
        assert r["params_checksum"] == pytest.approx(ref_sum, rel=1e-6, abs=1e-4)
    assert state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        torch.testing.assert_close(state[name], tensor, msg=lambda m, n=name: f"{n}: {m}")
    # training moved the weights (the comparison is not vacuous)
    initial = nn.Sequential(*spec.layers()).state_dict()
    assert any(not torch.equal(initial[k], ref_state[k]) for k in ref_state)


@pytest.mark.timeout(180)
def test_torch_pipelining_matches_single_process():
    spec = tiny_spec()
    results = spawn_peer(torch_pipelining_worker, spec, timeout_s=150, with_state=True)
    check_against_reference(results, spec, "torch_pipelining_1f1b")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_deepspeed_matches_single_process(checkpointing: bool):
    pytest.importorskip("deepspeed")
    spec = tiny_spec()
    results = spawn_peer(
        deepspeed_worker,
        spec,
        timeout_s=350,
        worker_kwargs={"activation_checkpointing": checkpointing},
        with_state=True,
    )
    system = "deepspeed_pipeline_ckpt" if checkpointing else "deepspeed_pipeline"
    check_against_reference(results, spec, system)
    assert all(r["activation_checkpointing"] is checkpointing for r in results)


def _failing_worker(rank: int, world_size: int, master_port: int, spec, out_path: str) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")


def _sleeping_worker(rank: int, world_size: int, master_port: int, spec, out_path: str) -> None:
    time.sleep(600)


@pytest.mark.timeout(120)
def test_spawn_peer_names_the_system_when_a_rank_fails():
    with pytest.raises(RuntimeError, match="(?s)_failing_worker.*boom on purpose"):
        spawn_peer(_failing_worker, tiny_spec(), timeout_s=100)


@pytest.mark.timeout(120)
def test_spawn_peer_kills_ranks_past_the_deadline():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)_sleeping_worker.*still running"):
        spawn_peer(_sleeping_worker, tiny_spec(), timeout_s=4)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_module_imports_without_deepspeed():
    code = (
        "import sys; import trainwright.bench.peers; import trainwright.bench.deepspeed_peer as p; "
        "assert 'deepspeed' not in sys.modules; print(type(p.deepspeed_available()).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100
    )
    assert out.stdout.strip().splitlines()[-1] == "bool"
    assert isinstance(deepspeed_available(), bool)


def test_step_time_is_the_slowest_rank_after_warmup():
    results = [{"step_times_s": [9.0, 1.0, 3.0]}, {"step_times_s": [8.0, 2.0, 1.0]}]
    assert step_time_s(results, warmup=1) == [2.0, 3.0]
    assert step_time_s(results, warmup=3) == []


_ORPHAN = """
import multiprocessing as mp, os, sys, time
from trainwright.bench.peers import _exit_with_parent

def child(ready):
    _exit_with_parent(poll_s=0.05)
    open(ready, "w").close()
    time.sleep(60)

if __name__ == "__main__":
    ready = sys.argv[1]
    p = mp.get_context("spawn").Process(target=child, args=(ready,))
    p.start()
    if sys.argv[2] == "late":  # die while the child may still be importing
        time.sleep(0.2)
    else:
        while not os.path.exists(ready):
            time.sleep(0.05)
    print(p.pid, flush=True)
    os._exit(0)  # the parent dies without joining or killing it
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["watching", "late"])
def test_bench_rank_exits_when_its_parent_dies(tmp_path, when):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ready"), when],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pid = int(proc.stdout.readline())  # the child inherits the pipe: read one line only
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60  # a late child first finishes importing torch
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the orphaned bench rank kept running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
