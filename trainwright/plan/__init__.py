"""Planning: numbers in, plans out. Pure modules, no torch.

* :mod:`trainwright.plan.memory`: per-layer keep / swap / recompute policies under a
  stage's activation-memory limit.
"""

__all__: list[str] = []
