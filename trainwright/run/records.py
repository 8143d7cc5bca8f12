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

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.dist.mailbox import Mailbox
from trainwright.dist.topology import Topology
from trainwright.model.build import loss_fn
from trainwright.model.text_data import read_share
from trainwright.observe.flops import StepCost, count_flops, run_peak
from trainwright.observe.process_memory import peak_resident_bytes
from trainwright.observe.telemetry import RunRecorder
from trainwright.pipeline.runtime import StepStats

__all__ = ["StepRecords", "NodeRecords", "step_cost"]

log = logging.getLogger(__name__)


def step_cost(cfg: Config, build_layers: Callable[[], list], data, device: torch.device,
              ranks: int, step: int = 1) -> StepCost:
    """FLOPs of one global step of the whole model, the tokens in a sample and the peak of
    ``ranks`` devices like ``device`` (``observe.mfu``; else only the tokens).

    The FLOPs are counted from the layers (``FlopCounterMode``) over one forward, loss and
    backward of the global batch of ``step`` on the ``meta`` device: nothing is computed
    or allocated, whatever the model's size. A model that cannot be built there is counted
    on the CPU on one micro-batch, scaled to the batch.
    """
    with torch.random.fork_rng(devices=[]):  # a model builder may seed: leave ours as it was
        return _step_cost(cfg, build_layers, data, device, ranks, step)


def _step_cost(cfg: Config, build_layers: Callable[[], list], data, device: torch.device,
               ranks: int, step: int) -> StepCost:
    t = cfg.train
    x, y = read_share(data, step, t.batch_size, 0, 1, inputs=True, targets=True)
    token_ids = isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()
    tokens = int(x.shape[1]) if token_ids else None
    if not cfg.observe.mfu:
        return StepCost(None, None, tokens)
    criterion = loss_fn(cfg)

    def fwd_bwd(where: str, xs: torch.Tensor, ys: torch.Tensor) -> int:
        with torch.device(where):
            model = torch.nn.Sequential(*[layer for _, layer in build_layers()])
        # attention as matmuls: FlopCounterMode has no formula for the CPU's fused
        # attention kernel and would count it as nothing (on meta it decomposes anyway)
        with sdpa_kernel(SDPBackend.MATH):
            return count_flops(lambda: criterion(model(xs.to(where)), ys.to(where)).backward())

    # a figure to watch must never stop the training it watches: a model that cannot be
    # counted on meta is counted on the CPU, and one that cannot be counted has no MFU
    try:
        flops = fwd_bwd("meta", x, y)
    except Exception as exc:  # e.g. an op without a meta kernel, a builder that reads data
        log.info("counting FLOPs on one CPU micro-batch (not on meta: %s)", exc)
        parts = t.micro_batches * cfg.parallel.dp
        try:
            flops = fwd_bwd("cpu", x.chunk(parts)[0], y.chunk(parts)[0]) * parts
        except Exception as exc2:
            log.warning("no MFU for this run: its FLOPs could not be counted (%s)", exc2)
            return StepCost(None, None, tokens)
    return StepCost(flops, run_peak(device, t.precision, ranks), tokens)


def _recorder(cfg: Config, run_dir: Path, world: int, pp: int, dp: int, layer_names: list[str],
              stage_of: list[int], start: int, cost: Callable[[], StepCost] | None,
              mapping: list[int] | None = None) -> RunRecorder:
    """Rank 0's recorder, its ``run`` row describing the mesh, the partition and the
    stage-to-rank ``mapping`` (None: stage s on rank s)."""
    t = cfg.train
    meta = dict(config=cfg.to_dict(), world_size=world, pp=pp, dp=dp, schedule=t.schedule,
                layer_names=layer_names, mapping=mapping or list(range(pp)),
                partition=[[i for i, r in enumerate(stage_of) if r == k] for k in range(pp)])
    return RunRecorder(run_dir, meta, stage_of, t.batch_size, t.steps, start, cfg.run.progress,
                       cost=cost() if cost else None, loggers=cfg.observe.loggers)


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
        cost: builds rank 0's :class:`~trainwright.observe.flops.StepCost` (FLOPs per step,
            tokens per sample, peak), called on rank 0 only.
    """

    def __init__(self, cfg: Config, topo: Topology, run_dir: Path, layer_names: list[str],
                 stage_of: list[int], start: int, outputs: bool,
                 cost: Callable[[], StepCost] | None = None):
        self.cfg, self.topo = cfg, topo
        self.mailbox = None if topo.stats_group is None else Mailbox(
            topo.stats_group, topo.rank, topo.world_size)
        self.recorder: RunRecorder | None = None
        """Rank 0's metrics, progress and report writer (None on other ranks)."""
        if topo.rank == 0 and outputs:
            self.recorder = _recorder(cfg, run_dir, topo.world_size, topo.pp, topo.dp,
                                      layer_names, stage_of, start, cost,
                                      mapping=[topo.rank_of(s, 0) for s in range(topo.pp)])

    @property
    def needs_collective(self) -> bool:
        """No mailbox: per-layer costs and stats travel by collective."""
        return self.mailbox is None

    def step(self, step: int, stats: StepStats, costs: list[dict] | None,
             stage_of: list[int]) -> None:
        """This rank's stats of ``step`` to rank 0, which writes the metrics row (with the
        pipeline's per-layer ``costs`` at profile steps)."""
        stats.process_peak_bytes = peak_resident_bytes()  # since this rank's last row
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


class NodeRecords:
    """A token-ring run's metrics, progress and report, as a pipeline run has them: written
    by the node hosting the ring from its own steps (the ring has no rank 0 gathering
    everyone's stats; every node trains on an equal share and applies the same update).

    A row's ``loss`` is the host's share's; ``samples_per_s`` counts the whole global batch
    over the host's step time (a step closes when the ring applies it everywhere).

    Args:
        cfg: the run's configuration (not a node's one-stage view).
        run_dir: the run directory.
        trainer: the node's trainer (its layers, data and start step).
    """

    def __init__(self, cfg: Config, run_dir: Path, trainer):
        names = [slot.name for slot in trainer.stage.slots]
        self.recorder = _recorder(
            cfg, run_dir, cfg.tokenring.nodes, 1, cfg.tokenring.nodes, names,
            [0] * len(names), trainer.start,
            lambda: step_cost(cfg, trainer.build_layers, trainer.data, trainer.device,
                              cfg.tokenring.nodes))
        self.report, self.trainer = cfg.run.report, trainer

    def step(self, step: int, stats: StepStats | None) -> None:
        """The host's stats of ``step`` (None: the ring closed it without the host)."""
        if stats is not None:
            stats.process_peak_bytes = peak_resident_bytes()
            self.recorder.step(step, [stats], None)

    def finish(self) -> float | None:
        """Write the trace, the ``end`` row and the report; returns the final loss."""
        self.recorder.finish({0: self.trainer.trace_events}, {0: "node 0 (ring host)"},
                             self.report)
        return self.recorder.loss
