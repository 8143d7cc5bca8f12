"""Async saves copy the state while the saving step waits, into buffers kept from one save
to the next (issue 36, item 4): what a step changes after the save never reaches its files,
and a save that reuses the buffers leaves the one before it intact.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainwright.run import manifest
from trainwright.run.ckpt_writer import CheckpointWriter


def _saved(run_dir: Path, step: int, tmp: Path) -> dict:
    out = tmp / f"step{step}.pt"
    dcp_to_torch_save(manifest.final_dir(run_dir, step), out)
    return torch.load(out, weights_only=False)


@pytest.mark.filterwarnings("ignore:.*single process")  # DCP's, in its thread: no dist here
def test_async_save_copies_the_state_at_the_save_and_reuses_its_buffers(tmp_path):
    w, buf, note = torch.arange(8.0), torch.zeros(8), {"seen": [1]}
    writer = CheckpointWriter(tmp_path / "run", 0, asynchronous=True)
    writer.save(1, {"w": w, "buf": buf, "extra.note": (note,)}, {})
    w.add_(100)  # the next step's update, a forward changing a buffer, a registered
    buf.add_(1)  # object moving on: all after the copy, while the files are written
    note["seen"].append(2)
    writer.save(2, {"w": w, "buf": buf, "extra.note": (note,)}, {})  # into the same buffers
    w.add_(100)
    writer.close()
    first, second = (_saved(tmp_path / "run", s, tmp_path) for s in (1, 2))
    torch.testing.assert_close(first["w"], torch.arange(8.0), rtol=0, atol=0)
    torch.testing.assert_close(first["buf"], torch.zeros(8), rtol=0, atol=0)
    assert first["extra.note"] == ({"seen": [1]},)
    torch.testing.assert_close(second["w"], torch.arange(8.0) + 100, rtol=0, atol=0)
    torch.testing.assert_close(second["buf"], torch.ones(8), rtol=0, atol=0)
    assert second["extra.note"] == ({"seen": [1, 2]},)
    for s in (1, 2):
        assert manifest.verify(manifest.final_dir(tmp_path / "run", s)) is None


@pytest.mark.timeout(300)
def test_bench_checkpoint_judges_the_saving_step_against_the_same_runs_quiet_steps():
    from argparse import Namespace

    from trainwright.bench import checkpoint as bench

    r = bench.main(Namespace(spec=["d_model=64", "n_blocks=2", "every=3"], steps=10,
                             repeats=2))
    per = r["per_round"]
    assert [len(per[s]) for s in bench.SYSTEMS] == [2, 2]
    ratios = [x["save_step_s"] / x["quiet_step_s"] for x in per["async"]]
    assert r["async_save_step_over_quiet_step"] == round(statistics.median(ratios), 4)
    assert all(x["quiet_steps"] >= 1 for s in bench.SYSTEMS for x in per[s])
    against_blocking = [x["save_step_s"] / q["quiet_step_s"]
                        for x, q in zip(per["async"], per["blocking"], strict=True)]
    assert r["async_save_step_over_blocking_quiet_step_judged"]["median"] == round(
        statistics.median(against_blocking), 4)
    means = [x["mean_step_s"] / q["mean_step_s"]
             for x, q in zip(per["async"], per["blocking"], strict=True)]
    assert r["async_mean_step_over_blocking_mean_step"]["ratio"] == round(
        statistics.median(means), 4)
    assert r["host"]["cpus"] >= 1
