"""Tied weights across pipeline stages: one gradient, identical copies (Megatron's
embedding group, for any tie and any placement).

With ``parallel.pp > 1`` every layer holding a tied weight keeps its own copy
(:func:`~trainwright.model.ties.untie`), on whichever stage it lives. At ``SYNC``,
:class:`TiedGradSync` first lets the data-parallel exchange average every gradient over
the replicas, then, per tie, sums the copies' gradients on this stage and all-reduces the
sum over a ``torch.distributed`` group of the stages of this replica that hold the tie;
every copy receives the total, which is the gradient of the shared weight in the
single-process model. The copies start equal, receive equal gradients (an all-reduce
hands every member the same bits) and step with equal optimizer state, so they stay equal.
Because each layer owns its copy with its own gradient and optimizer state, a live
migration moves a tied layer like any other; the trainer announces the partition a
migration step reaches (:func:`expect_partition`) and the groups follow it (one
``new_group`` per holder set, created on every rank in the same order, then cached).

With one stage the layers share one parameter object, which sits in the first holder's
optimizer only (:func:`owned_parameters`), so it is stepped once.

Combinations that cannot keep a tie are refused before any process starts
(:func:`check_ties`): model edits (``rebalance.edits`` renumber layers) and
``sync.strategy = "hierarchical"`` with several stages (its sharded optimizer steps the
copies in different slices).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainwright.config import Config
from trainwright.dist import collective
from trainwright.dist.topology import Topology
from trainwright.errors import ConfigError
from trainwright.model.ties import Tie, find_ties, untie
from trainwright.sync.base import GradShard, GradSync, WeightUpdate

__all__ = ["check_ties", "prepare_ties", "owned_parameters", "TiedGradSync", "wrap_tied",
           "expect_partition", "counts_after", "duplicate_copies"]


def check_ties(cfg: Config, named: list[tuple[str, nn.Module]]) -> list[Tie]:
    """The model's ties; raises ConfigError for a configuration that cannot keep them."""
    ties = find_ties(named)
    if not ties:
        return ties
    what = ties[0].describe([n for n, _ in named])
    if cfg.rebalance.edits:
        raise ConfigError(f"rebalance.edits = {cfg.rebalance.edits!r} cannot be used with tied "
                          f"weights ({what}): inserting or removing layers renumbers the tie; "
                          f"unset rebalance.edits or untie the weights")
    if cfg.sync.strategy == "hierarchical" and cfg.parallel.pp > 1:
        raise ConfigError(f"sync.strategy = 'hierarchical' cannot keep tied weights ({what}) "
                          f"equal across stages (its sharded optimizer steps each copy in "
                          f"different slices); use sync.strategy = 'dense' or parallel.pp = 1")
    return ties


def prepare_ties(cfg: Config, named: list[tuple[str, nn.Module]]) -> list[Tie]:
    """Check the ties and, with several stages, give each holder its own copy."""
    ties = check_ties(cfg, named)
    if ties and cfg.parallel.pp > 1:
        untie(named, ties)
    return ties


def owned_parameters(module: nn.Module, seen: set[int]) -> list[nn.Parameter]:
    """``module``'s parameters not already given to an earlier layer's optimizer on this
    stage (a weight shared by two layers of one stage is stepped once); marks them seen."""
    out = [p for p in module.parameters() if id(p) not in seen]
    seen.update(id(p) for p in out)
    return out


def duplicate_copies(ties: list[Tie], slots: list) -> list[nn.Parameter]:
    """This stage's copies of tied weights that a global statistic must skip.

    After :class:`TiedGradSync` every copy holds the whole gradient of the shared weight, so
    a sum over all stages (the global gradient norm for clipping) counts a tie once only
    by skipping every copy but the one of the tie's first layer (as Megatron-LM does).

    Args:
        ties: the model's ties.
        slots: this stage's ``LayerSlot`` list.
    """
    local = {s.index: s.module for s in slots}
    first = {id(local[t.members[0][0]].get_parameter(t.members[0][1]))
             for t in ties if t.members[0][0] in local}
    out: dict[int, nn.Parameter] = {}
    for tie in ties:
        for index, pname in tie.members[1:]:
            if index in local:
                p = local[index].get_parameter(pname)
                if id(p) not in first:  # one stage, one object: it counts (once)
                    out[id(p)] = p
    return list(out.values())


def counts_after(counts: list[int], moves) -> list[int]:
    """Layers per stage once ``moves`` (``rebalance.moves.Move``) are done."""
    out = list(counts)
    for mv in moves:
        out[mv.giver] -= len(mv.layers)
        out[mv.receiver] += len(mv.layers)
    return out


class TiedGradSync(GradSync):
    """A gradient exchange that also sums tied copies across stages (see module docstring).

    Args:
        inner: the data-parallel exchange; every other hook of the interface goes to it.
        ties: the model's ties (:func:`~trainwright.model.ties.find_ties`).
        topo: this rank's mesh.
        stage: this rank's :class:`~trainwright.pipeline.stage.Stage` (its current slots).
        counts: the partition at the start, layers per stage.
    """

    def __init__(self, inner: GradSync, ties: list[Tie], topo: Topology, stage,
                 counts: list[int], stage_ranks: list[int] | None = None):
        self.inner, self.ties, self.topo, self.stage = inner, ties, topo, stage
        self.stage_ranks = stage_ranks  # model stage -> pipeline rank (None: the identity)
        self._groups: dict[tuple[int, ...], object] = {}
        self._mine: list[tuple[int, ...]] = []
        self.set_partition(counts)

    def set_partition(self, counts: list[int]) -> None:
        """Use the groups of partition ``counts``; every rank calls this with the same
        ``counts`` at the same point (groups are created collectively)."""
        stage_of = [k for k, n in enumerate(counts) for _ in range(n)]
        mine = []
        for tie in self.ties:
            for d in range(self.topo.dp):
                ranks = tuple(sorted({self.topo.rank_of(self._rank_of(stage_of[i]), d)
                                      for i in tie.layers}))
                if len(ranks) > 1 and ranks not in self._groups:
                    self._groups[ranks] = dist.new_group(list(ranks))
                if d == self.topo.replica:
                    mine.append(ranks)
        self._mine = mine

    def _rank_of(self, stage: int) -> int:
        return stage if self.stage_ranks is None else self.stage_ranks[stage]

    def sync(self, params: list) -> None:
        """Average over replicas (the inner exchange), then sum every tie's copies."""
        self.inner.sync(params)
        slots = {s.index: s.module for s in self.stage.slots}
        for tie, ranks in zip(self.ties, self._mine, strict=True):
            copies = {}
            for index, pname in tie.members:
                if index in slots:
                    p = slots[index].get_parameter(pname)
                    copies[id(p)] = p
            if copies:
                self._sum(list(copies.values()), ranks)

    def _sum(self, copies: list[nn.Parameter], ranks: tuple[int, ...]) -> None:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in copies]
        total = torch.stack([g.to_dense() if g.is_sparse else g for g in grads]).sum(0)
        if len(ranks) > 1:
            collective.all_reduce(total, group=self._groups[ranks])
        for p in copies:
            p.grad = total.clone() if len(copies) > 1 else total

    def weight_update(self, stage) -> WeightUpdate:
        """The inner exchange's update."""
        return self.inner.weight_update(stage)

    def grad_shard(self) -> GradShard | None:
        """The inner exchange's shard."""
        return self.inner.grad_shard()

    def attach(self, modules: list) -> None:
        """Pass the stage's layers on to the inner exchange."""
        self.inner.attach(modules)

    def layers_changing(self, slots: list) -> None:
        """As the inner exchange."""
        self.inner.layers_changing(slots)

    def full_state(self, slots: list):
        """The inner exchange's context (its layers' optimizers hold their full state)."""
        return self.inner.full_state(slots)

    def begin_step(self, step: int) -> bool:
        """As the inner exchange."""
        return self.inner.begin_step(step)

    def applied_through(self, step: int) -> int:
        """As the inner exchange."""
        return self.inner.applied_through(step)


def wrap_tied(inner: GradSync, ties: list[Tie], topo: Topology, stage,
              counts: list[int], stage_ranks: list[int] | None = None) -> GradSync:
    """``inner`` wrapped in :class:`TiedGradSync` when ties can span stages, else itself
    (``stage_ranks``: the pipeline rank of every model stage, for several stages per rank)."""
    if not ties or topo.pp == 1:
        return inner
    return TiedGradSync(inner, ties, topo, stage, counts, stage_ranks)


def expect_partition(sync: GradSync, counts: list[int]) -> None:
    """Tell a :class:`TiedGradSync` the partition this step's migration reaches (no-op for
    any other exchange). Every rank calls it before the step runs."""
    if isinstance(sync, TiedGradSync):
        sync.set_partition(counts)
