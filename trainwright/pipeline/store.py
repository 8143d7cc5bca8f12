"""The activation store: every held layer segment, with byte accounting.

A *segment* is one layer's forward for one micro-batch: its detached input, its output
(which owns the autograd graph) and the storages autograd saved for backward. The store
counts bytes by unique storage, so a tensor that is both one layer's output and the next
layer's saved input is counted once, and parameters (which autograd also saves) are not
counted at all. Policies other than *keep* (swap, recompute, peer swap) plug in here.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["Segment", "ActivationStore", "as_tuple"]


def as_tuple(x) -> tuple:
    """A layer value as a tuple of tensors (a bare tensor becomes a 1-tuple)."""
    return x if isinstance(x, tuple) else (x,)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


@dataclass
class Segment:
    """One layer's forward on one micro-batch, held until its backward."""

    layer: int
    mb: int
    inputs: tuple
    """Detached inputs (floating ones require grad, so their ``.grad`` is the result)."""
    outputs: tuple
    """Outputs holding the segment's autograd graph (the loss on the last layer)."""
    storages: dict = field(default_factory=dict)
    """storage key -> bytes of everything this segment keeps alive for backward."""


class ActivationStore:
    """Holds segments between forward and backward and accounts their bytes.

    Args:
        exclude: storage keys never counted (the stage's parameters and buffers).
    """

    def __init__(self, exclude: set | None = None):
        self.exclude = set(exclude or ())
        self._segments: dict[tuple[int, int], Segment] = {}
        self._refs: dict = defaultdict(int)
        self._sizes: dict = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.peak_microbatches = 0

    def exclude_params(self, modules) -> None:
        """Never count the storages of these modules' parameters and buffers."""
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                self.exclude.add(_storage_key(t))

    @contextmanager
    def capture(self, layer: int, mb: int):
        """Record the storages autograd saves while the body runs; yields a dict to fill."""
        saved: dict = {}

        def pack(t: torch.Tensor):
            key = _storage_key(t)
            if key not in self.exclude:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved

    def put(self, seg: Segment) -> None:
        """Hold a segment (its input storages are counted as kept)."""
        key = (seg.layer, seg.mb)
        if key in self._segments:
            raise RuntimeError(f"layer {seg.layer} micro-batch {seg.mb} is already held")
        for t in seg.inputs:
            if isinstance(t, torch.Tensor) and _storage_key(t) not in self.exclude:
                seg.storages[_storage_key(t)] = t.untyped_storage().nbytes()
        self._segments[key] = seg
        for k, n in seg.storages.items():
            if self._refs[k] == 0:
                self.bytes += n
                self._sizes[k] = n
            self._refs[k] += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_microbatches = max(self.peak_microbatches, len(self.microbatches()))

    def pop(self, layer: int, mb: int) -> Segment:
        """Release and return the segment of ``layer`` on micro-batch ``mb``."""
        try:
            seg = self._segments.pop((layer, mb))
        except KeyError:
            raise RuntimeError(f"no activations held for layer {layer} micro-batch {mb}; "
                               f"backward without forward") from None
        for k in seg.storages:
            self._refs[k] -= 1
            if self._refs[k] == 0:
                self.bytes -= self._sizes.pop(k)
                del self._refs[k]
        return seg

    def microbatches(self) -> set[int]:
        """Micro-batches with at least one segment held."""
        return {mb for _, mb in self._segments}

    def held(self) -> list[tuple[int, int]]:
        """``(layer, mb)`` of every held segment."""
        return list(self._segments)

    def reset_peaks(self) -> None:
        """Start a new accounting window (each step)."""
        self.peak_bytes = self.bytes
        self.peak_microbatches = len(self.microbatches())
