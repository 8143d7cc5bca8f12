"""Per-layer working sets measured during profiling: the footprint model's activation terms.

:class:`WorkingSetProbe` is a ``TorchDispatchMode`` that counts every storage an op creates
(parameters excluded) until it is freed, like the benchmarks' live-storage meter, so the
terms it measures are in the meter's own units. Around each layer's forward it records the
highest bytes alive at once that the layer created (``work``) and what is still alive when
the forward returns (``kept``: saved for backward plus output); see
:mod:`trainwright.plan.footprint`.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WorkingSetProbe"]


class WorkingSetProbe(TorchDispatchMode):
    """Live bytes of storages created while the mode is active, and per-layer peaks.

    Args:
        exclude: storage addresses never counted (parameters and buffers).
    """

    def __init__(self, exclude: set[int] | None = None):
        super().__init__()
        self.exclude = set(exclude or ())
        self._live: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0
        self.layers: dict[int, tuple[int, int]] = {}
        """layer -> (work, kept) of its last measured forward."""
        self.nograd: dict[int, int] = {}
        """layer -> work of the same forward run without a graph (as recompute's first)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out

    def _add(self, st) -> None:
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self.exclude or key in self._live:
            return
        self._live[key] = n
        weakref.finalize(st, self._release, key)
        self.bytes += n
        self.peak = max(self.peak, self.bytes)

    def _release(self, key: int) -> None:
        self.bytes -= self._live.pop(key, 0)

    def measure(self, layer: int, run):
        """Run ``run()`` (one layer's forward) and record its ``(work, kept)``, then run it
        again under ``torch.no_grad`` for :attr:`nograd`; returns the first result."""
        base, self.peak = self.bytes, self.bytes
        out = run()
        self.layers[layer] = (self.peak - base, self.bytes - base)
        base, self.peak = self.bytes, self.bytes
        with torch.no_grad():
            again = run()
        self.nograd[layer] = self.peak - base
        del again
        return out
