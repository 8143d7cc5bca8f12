"""The rank mesh with named axes ``pp`` (pipeline stages) and ``dp`` (replicas).

Global rank ``r = replica * pp + order[stage]``: the stages of one pipeline hold one block
of ``pp`` neighbouring ranks, so on a multi-GPU node they share the fast intra-node links.
``order`` is the stage-to-rank mapping inside the block (``parallel.mapping``, from a plan
whose device-mapping search put a heavy stage next to a light one over a fast link); the
identity by default. Send/receive peers, the data-parallel groups (stage ``s`` of every
replica) and log names all go through :meth:`Topology.rank_of` and :attr:`Topology.stage`,
so they follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["Topology"]


@dataclass
class Topology:
    """Where this rank sits in the ``pp x dp`` mesh, and the process groups along each axis.

    Build with :meth:`create` after ``init_process_group``; nothing is global.
    """

    pp: int
    dp: int
    rank: int
    pp_group: object = field(default=None, repr=False)
    """Process group of this rank's pipeline (all stages of its replica)."""
    dp_group: object = field(default=None, repr=False)
    """Process group of this rank's stage across replicas."""
    ctrl_group: object = field(default=None, repr=False)
    """A second group over this rank's pipeline for control traffic (re-partition plans,
    layer migration), so its messages never queue behind activations on the data group."""
    order: list[int] = field(default_factory=list)
    """``order[s]``: the position, inside its replica's block of ``pp`` ranks, of the rank
    that runs stage ``s`` (a permutation; empty = the identity)."""
    stats_group: object = field(default=None, repr=False)
    """A gloo group of every rank: per-step records travel to rank 0 on it
    (:class:`~trainwright.dist.mailbox.Mailbox`), whatever backend carries the tensors."""

    def __post_init__(self) -> None:
        if not self.order:
            self.order = list(range(self.pp))
        if sorted(self.order) != list(range(self.pp)):
            raise ValueError(f"stage-to-rank mapping {self.order} is not a permutation of "
                             f"0..{self.pp - 1}; give each of the {self.pp} stages its own "
                             f"rank (parallel.mapping)")

    def destroy(self) -> None:
        """Destroy this rank's groups. A process that builds many trainers in turn (a
        benchmark, a test session) would otherwise keep every one's connections and threads."""
        groups = {id(g): g for g in (self.pp_group, self.ctrl_group, self.dp_group,
                                     self.stats_group) if g is not None}
        for g in groups.values():
            dist.destroy_process_group(g)
        self.pp_group = self.ctrl_group = self.dp_group = self.stats_group = None

    @property
    def world_size(self) -> int:
        """``pp * dp``."""
        return self.pp * self.dp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_of(self.rank)

    def stage_of(self, rank: int) -> int:
        """The pipeline stage global ``rank`` runs."""
        return self.order.index(rank % self.pp)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica index."""
        return self.rank // self.pp

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this rank's replica)."""
        replica = self.replica if replica is None else replica
        if not (0 <= stage < self.pp and 0 <= replica < self.dp):
            raise IndexError(f"stage {stage} / replica {replica} is outside the "
                             f"{self.pp}x{self.dp} mesh")
        return replica * self.pp + self.order[stage]

    def describe(self, rank: int) -> str:
        """``"rank 3 (stage 1, replica 1)"`` for log messages."""
        return f"rank {rank} (stage {self.stage_of(rank)}, replica {rank // self.pp})"

    @classmethod
    def create(cls, pp: int, dp: int, order: list[int] | None = None) -> Topology:
        """Create the pipeline and replica groups. Every rank of the job must call this.

        Args:
            pp: pipeline stages.
            dp: data-parallel replicas.
            order: the stage-to-rank mapping inside each replica's block (default identity).

        Returns:
            This rank's topology with its groups.

        Raises:
            ValueError: the job's world size is not ``pp * dp``.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != pp * dp:
            raise ValueError(f"job has {world} ranks but pp={pp} x dp={dp} needs {pp * dp}; "
                             f"launch {pp * dp} processes or change parallel.pp / parallel.dp")
        topo = cls(pp=pp, dp=dp, rank=rank, order=list(order or []))
        for d in range(dp):  # every rank takes part in creating every group
            g = dist.new_group([d * pp + s for s in range(pp)])
            c = dist.new_group([d * pp + s for s in range(pp)])
            if d == topo.replica:
                topo.pp_group, topo.ctrl_group = g, c
        for s in range(pp):
            g = dist.new_group([topo.rank_of(s, d) for d in range(dp)])
            if s == topo.stage:
                topo.dp_group = g
        if world > 1:
            topo.stats_group = dist.new_group(list(range(world)), backend="gloo")
        return topo
