"""The pipeline runtime: a stage as an ordered list of layers, each its own autograd segment.

* :mod:`~trainwright.pipeline.runtime`: the executor of a stage's action list;
  :mod:`~trainwright.pipeline.interleaved`: of several model chunks per rank;
* :mod:`~trainwright.pipeline.split_backward`, :mod:`~trainwright.pipeline.deferred_linear`:
  a backward split into B (input gradients) and W (weight gradients later);
* :mod:`~trainwright.pipeline.tied`: tied weights across stages, one gradient;
* :mod:`~trainwright.pipeline.stage`, :mod:`~trainwright.pipeline.store`,
  :mod:`~trainwright.pipeline.swap`: layer segments, the activation store (keep / swap /
  recompute, byte accounting), host swap;
* :mod:`~trainwright.pipeline.budget`: a memory limit -> per-layer policies;
  :mod:`~trainwright.pipeline.profile`: one micro-batch through the model, measured (costs
  and footprint terms); :mod:`~trainwright.pipeline.workset`: the profile's per-layer
  working sets (the footprint model's terms);
* :mod:`~trainwright.pipeline.peerswap`, :mod:`~trainwright.pipeline.peer_setup`: peer swap
  at run time.

May import: errors, schedule, plan, config, observe, model, dist, sync (not tokenring,
rebalance, run, bench, cli).
"""
