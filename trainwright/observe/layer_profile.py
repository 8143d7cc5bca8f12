"""Per-layer cost table collected during normal steps: time, saved bytes, output bytes.

Collection is a timer pair around each layer's forward and backward (the wall clock on a
CPU, CUDA events on a GPU, read at :meth:`LayerProfiler.end_step` so that a step never
waits for its own timing) plus the byte counts the activation store already computes, so
it runs on every step at little extra cost. Planners read :meth:`LayerProfiler.table` (pure data).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import SupportsFloat

__all__ = ["LayerCost", "LayerProfiler"]


@dataclass
class LayerCost:
    """Costs of one layer, per micro-batch (times smoothed over steps)."""

    layer: int
    name: str
    forward_s: float = 0.0
    backward_s: float = 0.0
    saved_bytes: int = 0
    """Unique storages autograd keeps for this layer's backward (parameters and the layer's
    input excluded): what a swap or recompute policy can free."""
    input_bytes: int = 0
    """Bytes of the layer's input (held under every policy)."""
    output_bytes: int = 0
    """Bytes of the layer's output (what crosses a stage boundary cut after it)."""
    param_bytes: int = 0
    weight_s: float = 0.0
    """Of ``backward_s``, what a split backward's ``W`` computes (the weight gradients a
    zero-bubble schedule defers); 0: not measured (planners take half)."""

    def to_dict(self) -> dict:
        """Plain dict for metrics."""
        return asdict(self)


class LayerProfiler:
    """Accumulates per-layer costs within a step and smooths them across steps.

    Args:
        smoothing: weight of the newest step in the exponential moving average of times.
        warmup_steps: a layer's first steps on this stage (allocator and cache warm-up, up
            to 10x slower on CPU) are timed only when nothing else is known yet; the
            average starts afresh after them.
    """

    def __init__(self, smoothing: float = 0.3, warmup_steps: int = 1):
        self.smoothing, self.warmup_steps = smoothing, warmup_steps
        self.costs: dict[int, LayerCost] = {}
        self._step: dict[int, tuple[list, list]] = {}
        """layer -> this step's (forward, backward) readings, one per micro-batch."""
        self._seen: dict[int, int] = {}

    def register(self, layer: int, name: str, param_bytes: int) -> None:
        """Declare a layer this stage runs (again after a migration is harmless)."""
        self.costs.setdefault(layer, LayerCost(layer, name, param_bytes=param_bytes))

    def forget(self, layer: int) -> None:
        """Drop a layer that left this stage."""
        self.costs.pop(layer, None)
        self._step.pop(layer, None)
        self._seen.pop(layer, None)

    def renumber(self, mapping: dict[int, int]) -> None:
        """Layers changed index (a layer was inserted or removed): ``old -> new``."""
        self.costs = {mapping[k]: v for k, v in self.costs.items() if k in mapping}
        for k, c in self.costs.items():
            c.layer = k
        self._step = {mapping[k]: v for k, v in self._step.items() if k in mapping}
        self._seen = {mapping[k]: v for k, v in self._seen.items() if k in mapping}

    def forward(self, layer: int, seconds: SupportsFloat, saved_bytes: int | None,
                input_bytes: int, output_bytes: int) -> None:
        """Record one micro-batch's forward of ``layer`` (``seconds``: a float, or a timer's
        reading that ``float()`` resolves at :meth:`end_step`; ``saved_bytes`` None: not
        known yet, as under recompute, where :meth:`saved` reports it at backward)."""
        self._step.setdefault(layer, ([], []))[0].append((seconds,))
        c = self.costs[layer]
        c.input_bytes, c.output_bytes = input_bytes, output_bytes
        if saved_bytes is not None:
            c.saved_bytes = saved_bytes

    def saved(self, layer: int, saved_bytes: int) -> None:
        """Record the activation bytes of ``layer`` measured when its graph was rebuilt."""
        self.costs[layer].saved_bytes = saved_bytes

    def backward(self, layer: int, *seconds: SupportsFloat) -> None:
        """Record one micro-batch's backward of ``layer``, in one part or several (a split
        backward's ``B`` and ``W``), read as :meth:`forward`'s."""
        self._step.setdefault(layer, ([], []))[1].append(seconds)

    def end_step(self) -> None:
        """Fold this step's per-micro-batch means into the smoothed costs."""
        for layer, (fwd, bwd) in self._step.items():
            c = self.costs.get(layer)
            if c is None:
                continue
            fsum, bsum = (sum(float(x) for parts in got for x in parts) for got in (fwd, bwd))
            fn, bn = len(fwd), len(bwd)
            seen = self._seen[layer] = self._seen.get(layer, 0) + 1
            a = self.smoothing if c.forward_s and seen != self.warmup_steps + 1 else 1.0
            if fn:
                c.forward_s = (1 - a) * c.forward_s + a * fsum / fn
            if bn:
                c.backward_s = (1 - a) * c.backward_s + a * bsum / bn
        self._step.clear()

    def table(self) -> list[LayerCost]:
        """The cost of every layer on this stage, in layer order."""
        return [self.costs[k] for k in sorted(self.costs)]
