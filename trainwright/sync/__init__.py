"""Gradient synchronisation strategies across data-parallel replicas.

A strategy is a :class:`GradSync`: the pipeline runtime calls :meth:`GradSync.sync` at the
schedule's ``SYNC`` action (after the last backward of a step) and :meth:`GradSync.step` at
its ``STEP`` action. :func:`make_grad_sync` picks the strategy named by ``sync.strategy``
(and ``sync.sparse``) in the configuration.

* :mod:`~trainwright.sync.base`: the :class:`GradSync` interface and its hooks;
* :mod:`~trainwright.sync.dense`: bucketed all-reduce (the naive oracle);
* :mod:`~trainwright.sync.sparse` (+ ``rowsparse``, ``sparse_cost``, ``sparse_exchange``): sparse
  gradient sync; :mod:`~trainwright.sync.sparse_ddp`: its DDP-like wrapper for plain data
  parallel;
* :mod:`~trainwright.sync.hierarchical` (+ ``hier_sync``, ``hier_layout``, ``hier_shards``,
  ``hier_state``): hierarchical sharded sync.

May import: errors, schedule, plan, config, observe, model, dist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from trainwright.config import Config
    from trainwright.dist.topology import Topology

from trainwright.sync.base import GradSync

__all__ = ["GradSync", "make_grad_sync"]


def make_grad_sync(cfg: Config, topo: Topology) -> GradSync:
    """The strategy configured by ``cfg.sync`` for this rank's data-parallel group."""
    from trainwright.sync.dense import BucketedAllReduce

    strategy = cfg.sync.strategy
    if strategy == "dense" and cfg.sync.sparse:
        from trainwright.sync.sparse import sparse_sync_from_config

        return sparse_sync_from_config(cfg, topo.dp_group, topo.dp)
    if strategy == "dense":
        return BucketedAllReduce(topo.dp_group, topo.dp, int(cfg.parallel.bucket_mb * 2**20))
    if strategy == "hierarchical":
        from trainwright.sync.hierarchical import pipeline_sync
        return pipeline_sync(cfg, topo)
    from trainwright.errors import ConfigError

    ring = ("the ring's nodes train through trainwright.run.ring_node (started by `trainwright "
            "run --set sync.strategy=tokenring`, trainwright.fit or torchrun)")
    raise ConfigError(f"sync.strategy = {strategy!r} has no pipeline gradient sync: "
                      f"{ring if strategy == 'tokenring' else 'use dense'}")
