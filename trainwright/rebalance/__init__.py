"""Rebalancing a running pipeline: finding imbalance, planning moves, migrating layers live.

* :mod:`~trainwright.rebalance.detect`: when the stages are out of balance (smoothing,
  hysteresis, quiet periods), :class:`~trainwright.rebalance.detect.ImbalanceDetector`;
* :mod:`~trainwright.rebalance.moves`: the move plan, pure data: which layers move one hop
  (``Move``, ``one_hop_moves``) and where in a step's action lists the ``MIG_*`` actions go
  (``migration_schedule``);
* :mod:`~trainwright.rebalance.migration`: the executor of those actions on a stage
  (``Migration``: parameters, stored inputs, gradients and optimizer state on the wire);
  :mod:`~trainwright.rebalance.pack`, its wire format (a tree of tensors in two messages);
  :mod:`~trainwright.rebalance.catalog`, every layer's structure on every rank
  (``LayerCatalog``), from which a receiver builds the layers it gets;
* :mod:`~trainwright.rebalance.rebalancer`: ``Rebalancer``, on every rank: imbalance checks,
  the plan's way back along the pipeline, the migration schedule of each step;
* :mod:`~trainwright.rebalance.live`: ``LiveRebalancing``, the trainer's side of it: the
  edits and the migration of each step, and what the rank adopts after them;
* :mod:`~trainwright.rebalance.edits`: model edits between steps (insert / remove layers,
  the ``rebalance.edits`` hook) and an edited run's layers rebuilt for ``load_model``.

The pipeline runtime (:mod:`trainwright.pipeline`) runs a migration step without importing
this package; it declares what it needs of one (``pipeline.runtime.LiveMigration``).

May import: errors, schedule, plan, config, observe, model, dist, sync, tokenring, pipeline
(not run, bench, cli).
"""
