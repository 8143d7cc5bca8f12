"""Saving a rank's part of each checkpoint without stopping training.

With ``run.async_checkpoint`` each save goes through
:func:`torch.distributed.checkpoint.async_save`: the state is copied to memory (DCP's
stager copies the tensors and deep-copies the other entries) while the step waits, and a
DCP thread writes it; the next step runs meanwhile. The writes coordinate on a gloo group
of their own, so the background thread's collectives never interleave with the training
step's. Rank 0 completes the checkpoint (:func:`~trainwright.run.checkpoint.commit`: manifest,
rename) once DCP's future says every rank's files are in place, still in the background.

A save waits for the one before it, and :meth:`CheckpointWriter.wait` (called before a run
ends) waits for the last one, so a run never exits with a save half-done.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from trainwright.dist.faults import FaultPoint
from trainwright.run import checkpoint
from trainwright.run.manifest import remove_temporary

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)


class CheckpointWriter:
    """One rank's checkpoint saves, blocking or in the background.

    Every rank of the job saves at the same steps (with ``asynchronous`` and a process
    group, the first save creates the gloo group the background writes use).

    Args:
        run_dir: the run directory.
        rank: this rank (rank 0 completes each checkpoint).
        asynchronous: save through ``async_save`` (``run.async_checkpoint``).
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
        self._thread = ThreadPoolExecutor(1, "ckpt-commit") if asynchronous else None
        self._pending: Future | None = None
        if clean and rank == 0:
            remove_temporary(self.run_dir)

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Write ``state`` (this rank's entries) as part of the checkpoint of ``step``;
        ``meta`` goes into ``meta.json`` (rank 0). Returns once the state is copied (async)
        or written and completed (blocking)."""
        self.wait()  # one save at a time: the previous one completes first
        if self.asynchronous and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # collective: every rank saves now
        written = checkpoint.write_files(self.run_dir, step, state, group=self.group,
                                         asynchronous=self.asynchronous)
        if written is None:
            self._complete(step, meta, None)
        else:
            self._pending = self._thread.submit(self._complete, step, meta, written)

    def _complete(self, step: int, meta: dict, written: Future | None) -> None:
        if written is not None:
            written.result()  # every rank's files and the metadata are in place
        if self.fault is not None:
            self.fault.check(step)
        if self.rank == 0:
            checkpoint.commit(self.run_dir, step, meta)
            log.debug("checkpoint of step %d complete", step)

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
