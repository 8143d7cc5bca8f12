"""Saving a rank's part of each checkpoint without stopping training.

With ``run.async_checkpoint`` each save is two parts:

* **Staging**, while the saving step waits: each tensor is copied (``Tensor.copy_``) into a
  host buffer kept for it from one save to the next (pinned on CUDA hosts), every other
  entry (RNG states, registered objects) through ``pickle``. Kept buffers mean no fresh
  pages to fault in (a 268 MB state: 0.07 s the first time, 0.017 s after, on the 2-core
  host of docs/bench). DCP's :class:`~torch.distributed.checkpoint.staging.DefaultStager`
  does the same with storage copies and a recursive deep copy, and took 0.022 s there:
  its storage copies run slower than ``Tensor.copy_``, and it walks some 940 Python
  objects (the Python RNG state alone is 625 integers). That copy stays in host memory
  between saves.
* **Writing**, while the next steps run: :func:`torch.distributed.checkpoint.save` of the
  staged copy, on a thread of this writer that runs at nice :data:`WRITER_NICE`,
  coordinating on a gloo group of its own so that its collectives never interleave with
  the training step's. Rank 0 then completes the checkpoint
  (:func:`~trainwright.run.checkpoint.commit`: manifest and its checksums, rename) on
  the same thread.

Why not :func:`torch.distributed.checkpoint.async_save`: it writes on a thread of its own
at the trainer's priority. Writing and checksumming a 268 MB state takes 0.35 s of CPU; on
a host whose cores training keeps busy that thread took a core from the steps beside it,
and the step after a save took 3-4x a quiet one (0.56-0.75 s against 0.18, longer than a
blocking save). At nice 10 the write spreads over the next 15-30 steps there, each
10-15 % slower (:data:`WRITER_NICE` has the other values tried); a GPU run's host, mostly
waiting on the device, leaves the write idle cores. Nice is per thread on Linux;
elsewhere the thread keeps the trainer's priority.

A save waits for the one before it (then the write has the cores to itself), and
:meth:`CheckpointWriter.wait` (called before a run ends) waits for the last one, so a run
never exits with a save half-done. The cost moves, it does not vanish: ``trainwright bench
checkpoint`` reports the saving step, the steps beside a save and the mean step.

Staging in the background while the next step computes (what torchtitan does on GPUs with
a copy stream) was tried on CPU and measured no better: the stager's thread and the step
contend for the interpreter lock and the cores, and the saving step still took 17-34 ms
longer against 19-27 ms with the copy done in place.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.dist.faults import FaultPoint
from trainwright.run import checkpoint
from trainwright.run.manifest import remove_temporary

__all__ = ["CheckpointWriter", "WRITER_NICE"]

WRITER_NICE = 10
"""Nice value of the thread that writes and completes background saves. Against training
threads at nice 0 it gets about a tenth of a busy core, plus whatever training leaves idle
(measured on the 2-core host, 268 MB a save: nice 0, the step after a save 3-4x a quiet
one; 4, 1.6x over 12-21 steps; 10, 1.11-1.14x over 15-30 steps; 19, starved: the write was
still going 25 steps later and the next save waited for it)."""

log = logging.getLogger(__name__)


class CheckpointWriter:
    """One rank's checkpoint saves, blocking or in the background.

    Every rank of the job saves at the same steps (with ``asynchronous`` and a process
    group, the first save creates the gloo group the background writes use).

    Args:
        run_dir: the run directory.
        rank: this rank (rank 0 completes each checkpoint).
        asynchronous: stage, then write on a low-priority thread (``run.async_checkpoint``).
        fault: testing: the point where this rank dies in a save, after its files are
            written and before the checkpoint is completed.
        clean: a resumed run: rank 0 deletes the folders of saves an earlier process left
            unfinished (they can never be resumed; a later save of theirs starts afresh).
    """

    def __init__(self, run_dir: Path, rank: int, asynchronous: bool,
                 fault: FaultPoint | None = None, clean: bool = False):
        self.run_dir, self.rank, self.asynchronous, self.fault = Path(run_dir), rank, \
            asynchronous, fault
        self.group = None
        self._thread = ThreadPoolExecutor(1, "ckpt-writer", initializer=_lower_priority) \
            if asynchronous else None
        self._staging: dict[str, torch.Tensor] = {}
        """Per tensor entry, the host buffer its copy goes into, kept from save to save."""
        self._pending: Future | None = None
        self._warned = False
        if clean and rank == 0:
            remove_temporary(self.run_dir)

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Write ``state`` (this rank's entries) as part of the checkpoint of ``step``;
        ``meta`` goes into ``meta.json`` (rank 0). Returns once the state is copied (async)
        or written and completed (blocking)."""
        if self.writing and not self._warned:  # one save at a time: the previous first
            self._warned = True
            log.warning("checkpoint of step %d waits for the previous save, still being "
                        "written; raise run.checkpoint_every so that a write fits between "
                        "saves", step)
        self.wait()
        if self.asynchronous and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # collective: every rank saves now
        if not self.asynchronous:
            self._write(step, state, meta)
            return
        staged = self._stage(state)  # the step waits for this copy, not for the write
        self._pending = self._thread.submit(self._write, step, staged, meta)

    @torch.no_grad()
    def _stage(self, state: dict) -> dict:
        """A copy of ``state`` the training steps cannot change: each tensor copied into its
        kept host buffer (pinned for a CUDA tensor), every other entry through pickle."""
        kept, out = self._staging, {}
        self._staging = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                out[key] = pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
                continue
            buf = kept.get(key)
            if buf is None or (buf.shape, buf.dtype) != (value.shape, value.dtype):
                buf = torch.empty(value.shape, dtype=value.dtype,
                                  pin_memory=value.device.type == "cuda")
            out[key] = self._staging[key] = buf.copy_(value, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device-to-host copies are complete
        return out

    def _write(self, step: int, state: dict, meta: dict) -> None:
        checkpoint.write_files(self.run_dir, step, state, group=self.group)
        if self.fault is not None:
            self.fault.check(step)
        if self.rank == 0:
            checkpoint.commit(self.run_dir, step, meta)
            log.debug("checkpoint of step %d complete", step)

    @property
    def writing(self) -> bool:
        """Whether a save is still in progress (its copy, its files or its completion)."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the last save is complete (re-raising what made it fail)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the last save, then release the thread and the writes' group."""
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None


def _lower_priority() -> None:
    """Run the calling thread at nice :data:`WRITER_NICE` (Linux, where nice is per
    thread; elsewhere it would renice the whole process, so nothing changes). A sandbox
    that refuses it leaves the thread at the trainer's priority: saves still work."""
    if sys.platform.startswith("linux"):
        me = threading.get_native_id()
        try:  # never up: a trainer already niced past it keeps its own value
            os.setpriority(os.PRIO_PROCESS, me, max(WRITER_NICE, os.getpriority(
                os.PRIO_PROCESS, me)))
        except OSError as exc:
            log.info("checkpoint writer keeps the trainer's priority (%s)", exc)
