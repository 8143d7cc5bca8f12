"""Async saves copy the state while the saving step waits, into buffers kept from one save
to the next (issue 36, item 4): what a step changes after the save never reaches its files,
and a save that reuses the buffers leaves the one before it intact.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
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
    # a save this small may end within its own step: then no step ran beside it
    assert all((x["beside_step_s"] is None) == (x["beside_steps"] == 0) for x in per["async"])
    beside = [x["beside_step_s"] / x["quiet_step_s"] for x in per["async"]
              if x["beside_step_s"] is not None]
    assert r["async_beside_step_over_quiet_step"] == (
        round(statistics.median(beside), 4) if beside else None)
    assert all(x["beside_steps"] == 0 for x in per["blocking"])
    assert r["host"]["cpus"] >= 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux")
def test_background_writes_run_at_a_lower_cpu_priority(tmp_path):
    """The thread that writes and checksums a save runs at nice ``WRITER_NICE`` (or the
    trainer's own, if that is higher): at the trainer's priority the write took a core from
    the steps beside it (the step after a save took 3-4x a quiet one on the 2-core host of
    docs/bench)."""
    from torch.distributed.checkpoint import FileSystemWriter

    from trainwright.run.ckpt_writer import WRITER_NICE

    seen: dict[str, set] = {"write": set(), "checksum": set()}
    trainer = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def probe(kind, real):
        def wrapped(*args, **kwargs):
            seen[kind].add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return real(*args, **kwargs)
        return wrapped

    writer = CheckpointWriter(tmp_path / "run", 0, asynchronous=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FileSystemWriter, "write_data", probe("write", FileSystemWriter.write_data))
        mp.setattr(manifest, "_crc32", probe("checksum", manifest._crc32))
        writer.save(1, {"w": torch.arange(8.0)}, {})
        writer.close()
    lower = max(WRITER_NICE, trainer)
    assert seen == {"write": {lower}, "checksum": {lower}}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == trainer


@pytest.mark.filterwarnings("ignore:.*single process")
def test_a_save_that_waits_for_the_previous_write_says_so_once(tmp_path, monkeypatch):
    from trainwright.run import checkpoint, ckpt_writer

    release, warned, real = threading.Event(), threading.Event(), checkpoint.write_files

    def held_write(*args, **kwargs):  # the first save's write goes on until released
        release.wait(60)
        return real(*args, **kwargs)

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())
            warned.set()

    seen = Seen()
    ckpt_writer.log.addHandler(seen)
    monkeypatch.setattr(checkpoint, "write_files", held_write)
    writer = CheckpointWriter(tmp_path / "run", 0, asynchronous=True)
    try:
        writer.save(1, {"w": torch.zeros(4)}, {})
        second = threading.Thread(target=writer.save, args=(2, {"w": torch.ones(4)}, {}))
        second.start()  # warns, then waits for the first write
        assert warned.wait(60)
        release.set()
        second.join(60)
        writer.save(3, {"w": torch.ones(4)}, {})  # may wait again: said once per run
        writer.close()
    finally:
        release.set()
        ckpt_writer.log.removeHandler(seen)
    assert len(seen.messages) == 1, seen.messages
    assert "step 2" in seen.messages[0] and "run.checkpoint_every" in seen.messages[0]
    assert manifest.committed_steps(tmp_path / "run")[-2:] == [2, 3]


@pytest.mark.filterwarnings("ignore:.*single process")
def test_a_host_that_refuses_the_lower_priority_still_saves(tmp_path, monkeypatch):
    """Where setting the writer thread's nice value fails (a sandbox without it), the save
    goes on at the trainer's priority instead of breaking the writer's thread pool."""
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    writer = CheckpointWriter(tmp_path / "run", 0, asynchronous=True)
    writer.save(1, {"w": torch.arange(4.0)}, {})
    writer.close()
    assert manifest.committed_steps(tmp_path / "run") == [1]
