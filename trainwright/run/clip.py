"""Gradient clipping by the global norm over every stage and replica (``train.clip_norm``).

After the data-parallel sync each replica of a stage holds the same averaged gradient
(dense and sparse sync), so the norm's sum of squares is taken once per stage and
all-reduced over the pipeline group only; summing over the replicas too would count every
gradient ``dp`` times. With ``sync.strategy = "hierarchical"`` a rank holds the averaged
gradient of its own slice only: slices are summed inside the node (each slice once), then
over the pipeline. Sparse (row) gradients count their coalesced values. The coefficient is
``clip_grad_norm_``'s: ``min(max_norm / (norm + 1e-6), 1)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll
from trainwright.sync.base import GradShard

__all__ = ["local_square_sum", "global_grad_norm", "scale_gradients"]


def _square_sum(g: torch.Tensor) -> torch.Tensor:
    if g.is_sparse:
        g = g.coalesce().values()
    return g.detach().double().pow(2).sum()


def local_square_sum(params: list, shard: GradShard | None = None) -> torch.Tensor:
    """This rank's share of the squared global norm (float64 scalar on the CPU).

    ``shard``: where the synced gradients live when this rank holds only a slice of them
    (:meth:`GradSync.grad_shard`); the slices are summed over its group (each once).
    """
    if shard is not None:
        total = _square_sum(shard.owned).cpu().reshape(1)
        if shard.group is not None:
            coll.all_reduce(total, group=shard.group)
        return total
    parts = [_square_sum(p.grad).cpu() for p in params if p.grad is not None]
    return torch.stack(parts).sum().reshape(1) if parts else torch.zeros(1, dtype=torch.float64)


def global_grad_norm(params: list, pp_group=None, shard: GradShard | None = None) -> float:
    """The L2 norm of every gradient of the model (all stages), the same on every rank."""
    total = local_square_sum(params, shard)
    if dist.is_initialized():
        coll.all_reduce(total, group=pp_group)
    return float(total.sqrt())


def scale_gradients(params: list, max_norm: float, norm: float,
                    shard: GradShard | None = None) -> float:
    """Multiply every gradient (or the owned ``shard``) by ``min(max_norm / (norm + 1e-6),
    1)``; return the factor."""
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef >= 1.0:
        return 1.0
    with torch.no_grad():
        if shard is not None:
            shard.owned.mul_(coef)
            return coef
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return coef
