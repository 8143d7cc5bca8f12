"""Hierarchical sharded gradient sync, slices sized by each device's memory.

Ranks that share a host form a *node* (under torchrun: ranks of one agent, ``GROUP_RANK``;
``hierarchical.ranks_per_node`` overrides that, to emulate nodes on one host). Every node
cuts the flat gradient into one slice per local rank, sized in proportion to the ranks'
free memory (optionally times their speed). One sync is:

1. intra-node reduce-scatter: local rank ``j`` receives slice ``j`` of every other local
   rank's gradient and sums it (point-to-point ``isend`` / ``irecv``, uneven sizes);
2. inter-node all-reduce of each slice among the ranks of the same local index;
3. (at ``step``) the sharded update: an optimizer that holds state for the owned slice only;
4. intra-node all-gather of the updated slices, straight into the flat parameter buffer.

Steps 1 and 2 are pipelined in ``chunks`` pieces per slice, so the slow inter-node
all-reduce of one piece runs while the next piece is still being reduced inside the node.

Why point-to-point for 1 and 4: torch 2.13's gloo ``reduce_scatter_tensor`` is a full
all-reduce plus a copy and there is no uneven reduce-scatter on gloo at all; per-slice
``dist.reduce`` is the other torch-native option (``intra="reduce"``), measured slower by
``trainwright bench hierarchical`` (see docs/hierarchical.md).

Parameters and gradients of the synced module become views into two flat buffers (as
DDP's ``gradient_as_bucket_view``), so the all-gather and the update need no copies. The
optimizer works on a flat 1-D parameter, so any element-wise torch optimizer (SGD, Adam,
AdamW, ...) gives the same result as on the full model; optimizers that look at a
parameter's shape (LBFGS, Adafactor) do not.

The sync itself is :mod:`trainwright.sync.hier_sync`; nodes, their groups and the slice
sizes live in :mod:`trainwright.sync.hier_layout`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from torch import nn

from trainwright.config import HierarchicalConfig
from trainwright.sync.hier_layout import (
    HierGroups,
    NodeLayout,
    create_groups,
    free_memory,
    host_names,
    measure_speed,
    node_layout,
    slice_bounds,
)
from trainwright.sync.hier_shards import assemble_flat
from trainwright.sync.hier_sync import HierarchicalSync, OptimizerFactory

__all__ = ["NodeLayout", "HierGroups", "node_layout", "create_groups", "slice_bounds",
           "free_memory", "measure_speed", "HierarchicalSync", "HierarchicalDataParallel",
           "pipeline_sync", "assemble_flat"]


# ----------------------------------------------------------------------------- front ends

class HierarchicalDataParallel(nn.Module):
    """Plain data parallel with the hierarchical sync: wrap a model, run forward/backward as
    usual, then ``sync()`` and ``step()`` (instead of ``optimizer.step()``).

    Every rank of ``members`` (default: the whole job) must build it, with the same
    ``cfg``; replicas must start from equal weights (same seed, or :meth:`load_shards`).
    Creating it is collective over the default group (it creates process groups).

    Args:
        module: the model.
        make_optimizer: e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``.
        cfg: the ``[hierarchical]`` section.
        members: global ranks that are replicas (default all).
        timeout_s: deadline of every wait.
    """

    def __init__(self, module: nn.Module, make_optimizer: OptimizerFactory,
                 cfg: HierarchicalConfig | None = None, members: Sequence[int] | None = None,
                 timeout_s: float = 300.0, intra: str = "p2p"):
        super().__init__()
        cfg = cfg or HierarchicalConfig()
        self.module = module
        members = list(range(dist.get_world_size())) if members is None else list(members)
        hosts = host_names() if cfg.ranks_per_node == 0 else None
        layout = node_layout(members, cfg.ranks_per_node, hosts)
        groups = create_groups([layout], dist.get_rank())
        self.hsync = HierarchicalSync(groups, make_optimizer, cfg, timeout_s, intra)
        self.hsync.setup([p for p in module.parameters() if p.requires_grad])

    def forward(self, *args, **kwargs):
        """The wrapped module's forward."""
        return self.module(*args, **kwargs)

    def sync(self) -> None:
        """Reduce-scatter + inter-node all-reduce of the gradients (after backward)."""
        self.hsync.sync(self.hsync.params)

    def step(self) -> None:
        """Sharded optimizer step, all-gather of the parameters, gradients cleared."""
        self.hsync.sharded_step()

    def save_shards(self, directory: str | Path) -> Path:
        """Write this rank's shard (see :meth:`HierarchicalSync.save_shard`)."""
        return self.hsync.save_shard(directory)

    def load_shards(self, directory: str | Path) -> None:
        """Load shards written by any number of ranks and assemble the full model."""
        self.hsync.load_shards(directory, self.hsync.params)


def pipeline_sync(cfg, topo) -> HierarchicalSync:
    """The strategy for ``sync.strategy = "hierarchical"`` inside the pipeline: each stage's
    replicas (its dp group) are arranged into nodes. Collective over the whole job."""
    from trainwright.model.build import build_optimizer

    h = cfg.hierarchical
    hosts = host_names() if h.ranks_per_node == 0 else None
    layouts = [node_layout([d * topo.pp + s for d in range(topo.dp)], h.ranks_per_node, hosts)
               for s in range(topo.pp)]
    logging.getLogger(__name__).info(
        "hierarchical sync: each stage's replicas on %d node(s) x %d rank(s) (nodes from %s)",
        layouts[0].nodes, layouts[0].ranks_per_node,
        f"hierarchical.ranks_per_node = {h.ranks_per_node}" if h.ranks_per_node else
        "torchrun's GROUP_RANK" if hosts and hosts[0].startswith("torchrun-node-") else
        "host names")
    groups = create_groups(layouts, topo.rank)
    return HierarchicalSync(groups, lambda ps: build_optimizer(cfg, ps), h,
                            cfg.runtime.collective_timeout_s)

