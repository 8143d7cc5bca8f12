"""Planning: numbers in, plans out. Pure modules, no torch.

* :mod:`trainwright.plan.memory`: per-layer keep / swap / recompute policies under a
  stage's activation-memory limit.
* :mod:`trainwright.plan.partition`: clusters -> k pipeline stages (seed 000's threshold
  rule with least communication, and the min-max optimum).
* :mod:`trainwright.plan.imbalance`: when to re-partition (smoothing, hysteresis, quiet
  periods around migrations).
"""

__all__: list[str] = []
