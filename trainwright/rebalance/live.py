"""A rank's side of rebalancing while it trains: model edits, live migrations, adopting them.

The trainer's step asks :class:`LiveRebalancing` three things, in order: which model
edits are due now (:meth:`LiveRebalancing.apply_edits`), which migration this step
performs (:meth:`LiveRebalancing.migration_for`), and, after the step, what the rank
adopts from it (:meth:`LiveRebalancing.adopt`). Around each change of layers the gradient
exchange hands the layers' optimizer state back first (it travels with them) and learns
the new layers after; the memory budget re-plans for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from trainwright.dist.comm import P2P
from trainwright.dist.topology import Topology
from trainwright.model.clusters import model_clusters
from trainwright.pipeline.budget import MemoryBudget
from trainwright.pipeline.stage import Stage
from trainwright.pipeline.tied import counts_after, expect_partition
from trainwright.rebalance.catalog import LayerCatalog
from trainwright.rebalance.edits import load_edit_hook
from trainwright.rebalance.migration import Migration
from trainwright.rebalance.rebalancer import Rebalancer
from trainwright.sync.base import GradSync

__all__ = ["LiveRebalancing", "layer_clusters"]

log = logging.getLogger(__name__)


def layer_clusters(named: list[tuple[str, torch.nn.Module]]) -> list[list[int]]:
    """Fork/join clusters of the model (one per layer when the graph cannot be read)."""
    try:
        return model_clusters([m for _, m in named])
    except Exception as exc:  # an opaque layer the tracer cannot read: cut anywhere
        log.warning("could not read the layer graph (%s); every layer is its own cluster",
                    str(exc).splitlines()[0][:200])
        return [[i] for i in range(len(named))]


class LiveRebalancing:
    """Model edits and live migrations on one rank of a training job.

    Args:
        cfg: the configuration (``[rebalance]``, the seed of inserted layers).
        topo: this rank's mesh.
        named: the whole model as ``(name, layer)`` pairs (the layer catalog, clusters).
        parts: the partition at the start, layers per stage.
        schedules: every stage's action list (where a migration's actions go).
        ctrl: transfers on the control group (plans, migrated layers).
        stage, sync, budget: this rank's stage, gradient exchange and memory budget, which
            follow every change of layers.
        make_optimizer: the optimizer of a layer created or received here.
        device: where received and inserted layers live.
    """

    def __init__(self, cfg, topo: Topology, named: list, parts: list[int], schedules: list,
                 ctrl: P2P, *, stage: Stage, sync: GradSync, budget: MemoryBudget,
                 make_optimizer: Callable, device: torch.device):
        rb = cfg.rebalance
        self.cfg, self.topo, self.stage, self.sync, self.budget = cfg, topo, stage, sync, budget
        self.make_optimizer, self.device = make_optimizer, device
        self.edit_hook = load_edit_hook(rb.edits) if rb.edits else None
        self.catalog = LayerCatalog(named)
        clusters = layer_clusters(named) if topo.stage == topo.pp - 1 else []
        self.rebalancer = Rebalancer(cfg, topo, parts, clusters, schedules, ctrl)

    def apply_edits(self, step: int) -> list | None:
        """Insert or remove the layers the config's edit hook asks for in ``step``.

        Returns:
            The edits applied (None: none due); the partition is then
            ``rebalancer.counts``.
        """
        edits = self.edit_hook(step) if self.edit_hook is not None else []
        if not edits:
            return None
        self.sync.layers_changing(self.stage.slots)
        self.rebalancer.apply_edits(
            edits, stage=self.stage, stage_index=self.topo.stage, catalog=self.catalog,
            device=self.device, seed=self.cfg.train.seed + step,
            make_optimizer=self.make_optimizer)
        self.sync.attach([slot.module for slot in self.stage.slots])
        self.budget.on_layers_changed()
        return edits

    def migration_for(self, step: int) -> Migration | None:
        """The live migration ``step`` performs, if the rebalancer planned one."""
        ms = self.rebalancer.migration_for(step)
        if ms is None:
            return None
        expect_partition(self.sync, counts_after(self.rebalancer.counts, ms.moves))
        if self._moves_here(ms.moves):
            self.sync.layers_changing(self.stage.slots)  # optimizer state travels with layers
        return Migration(ms, self.topo.stage, self.stage, self.rebalancer.ctrl,
                         self.topo.rank_of, self.catalog, self.make_optimizer, self.device)

    def adopt(self, migration: Migration) -> tuple[list[int], list[int], bool]:
        """After a migration step: take the partition it reached; when this rank's layers
        changed, the exchange learns them and memory is re-planned.

        Returns:
            ``(old, new, replanned)``: the partitions before and after, and whether the
            memory budget made a new plan.
        """
        old, new = self.rebalancer.step_done()
        replanned = False
        if self._moves_here(migration.plan.moves):
            self.sync.attach([slot.module for slot in self.stage.slots])
            replanned = self.budget.on_layers_changed() is not None
        return old, new, replanned

    def _moves_here(self, moves) -> bool:
        return any(self.topo.stage in (m.giver, m.receiver) for m in moves)
