"""A step's figures on their way to rank 0: metrics rows, the progress bar, the trace and
the report at the end.

Every rank hands its :class:`~trainwright.pipeline.runtime.StepStats` to
:class:`StepRecords` after each step. Through the mailbox
(:class:`~trainwright.dist.mailbox.Mailbox`) the ranks do not wait for each other: rank 0
writes a step's row when its next row is due (``RunRecorder.step_later``), from the other
ranks' stats sent a step earlier. Without a stats group (a lone rank) the stats are
gathered with a collective instead.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.dist.mailbox import Mailbox
from trainwright.dist.topology import Topology
from trainwright.observe.telemetry import RunRecorder
from trainwright.pipeline.runtime import StepStats

__all__ = ["StepRecords"]


class StepRecords:
    """Rank 0's recorder and the way every rank's stats reach it.

    Args:
        cfg: the configuration (the run's metadata, progress bar, report).
        topo: this rank's mesh.
        run_dir: where rank 0 writes.
        layer_names: the model's layers (the report labels).
        stage_of: the stage of every layer at the start.
        start: the first step of this run.
        outputs: whether rank 0 writes anything (a ring node writes its own report).
    """

    def __init__(self, cfg: Config, topo: Topology, run_dir: Path, layer_names: list[str],
                 stage_of: list[int], start: int, outputs: bool):
        self.cfg, self.topo = cfg, topo
        self.mailbox = None if topo.stats_group is None else Mailbox(
            topo.stats_group, topo.rank, topo.world_size)
        self.recorder: RunRecorder | None = None
        """Rank 0's metrics, progress and report writer (None on other ranks)."""
        if topo.rank == 0 and outputs:
            t = cfg.train
            meta = dict(config=cfg.to_dict(), world_size=topo.world_size, pp=topo.pp,
                        dp=topo.dp, schedule=t.schedule, layer_names=layer_names,
                        mapping=[topo.rank_of(s, 0) for s in range(topo.pp)],
                        partition=[[i for i, r in enumerate(stage_of) if r == k]
                                   for k in range(topo.pp)])
            self.recorder = RunRecorder(run_dir, meta, stage_of, t.batch_size, t.steps, start,
                                        cfg.run.progress)

    @property
    def needs_collective(self) -> bool:
        """No mailbox: per-layer costs and stats travel by collective."""
        return self.mailbox is None

    def step(self, step: int, stats: StepStats, costs: list[dict] | None,
             stage_of: list[int]) -> None:
        """This rank's stats of ``step`` to rank 0, which writes the metrics row (with the
        pipeline's per-layer ``costs`` at profile steps)."""
        if self.mailbox is None:
            gathered = self.gather(stats)
            if self.recorder is not None:
                self.recorder.step(step, gathered, costs, stage_of)
            return
        self.mailbox.post(stats)
        if self.topo.rank != 0:
            return
        mailbox, world = self.mailbox, self.topo.world_size
        others = lambda: [mailbox.take(r) for r in range(1, world)]  # noqa: E731
        if self.recorder is not None:
            self.recorder.step_later(step, stats, others, costs, list(stage_of))
        else:
            others()

    def write(self, kind: str, **row) -> None:
        """A row of its own (a model edit, an evaluation) on rank 0."""
        if self.recorder is not None:
            self.recorder.write(kind, **row)

    def gather(self, obj) -> list | None:
        """``obj`` of every rank on rank 0 (None elsewhere); a lone rank keeps its own."""
        return coll.gather_to_first(obj, self.topo.world_size, self.topo.rank)

    def finish(self, trace_events: list) -> float | None:
        """Gather the trace and write the report (rank 0); every rank waits for the end.

        Returns:
            The last step's mean loss on rank 0, None elsewhere.
        """
        if self.recorder is not None:
            self.recorder.settle()
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        all_events = self.gather(trace_events)
        topo = self.topo
        if self.recorder is not None:
            self.recorder.finish(dict(enumerate(all_events)),
                                 {r: topo.describe(r) for r in range(topo.world_size)},
                                 self.cfg.run.report)
        if dist.is_initialized():
            coll.barrier()
        return self.recorder.loss if self.recorder is not None else None
