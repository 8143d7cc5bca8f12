"""Deciding and sequencing re-partitions while training runs.

:class:`Rebalancer` lives on every rank. At check steps every stage's per-layer
forward+backward times reach the last stage (they are averaged over the data-parallel
replicas first, so every replica decides the same); the last stage feeds its stage times
to an :class:`~trainwright.rebalance.detect.ImbalanceDetector` and, on imbalance, partitions
the model's fork/join clusters with the threshold rule
(:func:`~trainwright.plan.partition.seed_partition`). The plan then travels back along
the backward path, stage by stage, on the control group. From the next step on, the
layers move with :mod:`~trainwright.rebalance.migration` (one hop per step; a plan needing
longer trips takes several steps), and no new plan is made until the target is reached.
"""

from __future__ import annotations

import logging

import torch

from trainwright.dist import collective as coll
from trainwright.dist.comm import P2P
from trainwright.plan.partition import ClusterCost, imbalance, seed_partition
from trainwright.rebalance.detect import ImbalanceDetector
from trainwright.rebalance.edits import apply_edits
from trainwright.rebalance.moves import MigrationSchedule, migration_schedule, one_hop_moves
from trainwright.schedule.actions import Action

__all__ = ["Rebalancer", "stage_times"]

log = logging.getLogger(__name__)


def stage_times(counts: list[int], layer_times: list[float]) -> list[float]:
    """Seconds per micro-batch of each stage: its layers' forward + backward times summed."""
    out, i = [], 0
    for c in counts:
        out.append(sum(layer_times[i:i + c]))
        i += c
    return out


class Rebalancer:
    """Imbalance checks, plan distribution and the migration schedule of each step.

    Args:
        cfg: the run configuration (``rebalance`` section).
        topo: this rank's topology (uses ``ctrl_group`` and ``dp_group``).
        counts: the current partition, layers per stage.
        clusters: layer indices of each fork/join cluster, in model order.
        schedules: the regular action lists of every stage (one step).
        ctrl: P2P on the control group.
    """

    def __init__(self, cfg, topo, counts: list[int], clusters: list[list[int]],
                 schedules: list[list[Action]], ctrl: P2P):
        rb = cfg.rebalance
        self.cfg, self.topo, self.ctrl = cfg, topo, ctrl
        self.counts = list(counts)
        self.clusters = clusters
        self.schedules = schedules
        self.detector = ImbalanceDetector(threshold_rel=rb.threshold_rel,
                                          threshold_s=rb.threshold_s or None,
                                          smoothing=rb.smoothing, patience=rb.patience,
                                          cooldown=rb.cooldown)
        self.target: list[int] | None = None
        self._after: list[int] | None = None
        self.decisions: list[dict] = []
        """Plans made on this rank (last stage), for the metrics."""

    @property
    def migrating(self) -> bool:
        """A plan is being applied (no new plan until it is)."""
        return self.target is not None

    def set_target(self, counts: list[int], why: str) -> None:
        """Move to partition ``counts`` from the next step on."""
        if list(counts) != self.counts:
            self.target = list(counts)
            log.info("re-partition %s -> %s (%s)", self.counts, self.target, why)

    def migration_for(self, step: int) -> MigrationSchedule | None:
        """The migration this step performs (None: the regular schedule)."""
        rb = self.cfg.rebalance
        if rb.at_step and step == rb.at_step:
            self.set_target(list(rb.to), f"rebalance.at_step = {step}")
        if self.target is None:
            return None
        moves, self._after = one_hop_moves(self.counts, self.target)
        return migration_schedule(self.schedules, moves, rb.switch_mb)

    def step_done(self) -> tuple[list[int], list[int]]:
        """The step's migration completed: adopt the partition it reached.

        Returns:
            The partition before and after the step.
        """
        before = list(self.counts)
        if self._after is None:
            return before, before
        self.counts, self._after = self._after, None
        if self.counts == self.target:
            self.target = None
            self.detector.repartitioned()
        return before, list(self.counts)

    def apply_edits(self, edits: list, **kwargs) -> list[int]:
        """Insert or remove layers between steps (see
        :func:`~trainwright.rebalance.edits.apply_edits`, which gets ``kwargs``); any pending
        re-partition target is dropped, since it was planned for the old model.

        Returns:
            The partition after the edits.
        """
        self.counts, self.clusters = apply_edits(edits, counts=self.counts,
                                                 clusters=self.clusters, **kwargs)
        self.target = None
        return list(self.counts)

    def check(self, step: int, costs: list[dict]) -> dict | None:
        """Imbalance check at a check step; every rank of the pipeline calls it.

        Args:
            step: the step just finished.
            costs: per-layer cost dicts of the whole pipeline (``LayerCost.to_dict``).

        Returns:
            The decision record on the last stage when a plan was made, else None.
        """
        n = sum(self.counts)
        times = torch.zeros(n, dtype=torch.float64)
        out_bytes = [0] * n
        for c in costs:
            if c["layer"] < n:
                times[c["layer"]] = c["forward_s"] + c["backward_s"]
                out_bytes[c["layer"]] = int(c["output_bytes"])
        if self.topo.dp > 1:  # every replica must decide the same
            coll.all_reduce(times, group=self.topo.dp_group)
            times /= self.topo.dp
        layer_times = times.tolist()
        s, p = self.topo.stage, self.topo.pp
        decision = None
        plan = [0] * (p + 1)
        if s == p - 1:
            decision = self._decide(step, layer_times, out_bytes)
            if decision is not None:
                plan = [1, *decision["new"]]
        else:  # the plan travels back along the backward path
            (got,) = self.ctrl.recv(self.topo.rank_of(s + 1), "plan", step)
            plan = got.tolist()
        if s > 0:
            self.ctrl.send(self.topo.rank_of(s - 1), "plan", step,
                           [torch.tensor(plan, dtype=torch.int64)])
            self.ctrl.wait_sends()
        if plan[0]:
            self.set_target(plan[1:], f"imbalance found at step {step}")
        return decision

    def _decide(self, step: int, layer_times: list[float], out_bytes: list[int]) -> dict | None:
        before = stage_times(self.counts, layer_times)
        if not all(t > 0 for t in layer_times):
            return None  # a layer has not been timed yet (just moved or inserted)
        if not self.detector.observe(before, migrating=self.migrating):
            return None
        rb = self.cfg.rebalance
        costs = [ClusterCost(tuple(c), sum(layer_times[i] for i in c), out_bytes[c[-1]])
                 for c in self.clusters]
        part = seed_partition(costs, self.topo.pp, rb.link_bandwidth,
                              threshold_s=rb.threshold_s or None, threshold_rel=rb.threshold_rel)
        new = [len(x) for x in part.stages]
        if new == self.counts or part.max_time > max(before) * (1 - rb.min_gain):
            log.info("stages unbalanced (%s) but the best plan %s gains less than %.0f %%; "
                     "keeping %s", [round(t * 1e3, 2) for t in before], new,
                     100 * rb.min_gain, self.counts)
            return None
        return {"step": step, "old": list(self.counts), "new": new, "rule": part.rule,
                "stage_times_before": before, "stage_times_predicted": part.stage_times,
                "imbalance_before": imbalance(before),
                "imbalance_predicted": imbalance(part.stage_times)}
