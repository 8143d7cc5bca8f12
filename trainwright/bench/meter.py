"""Measure what any training code keeps for backward, from the outside.

:class:`SavedTensorMeter` installs ``saved_tensors_hooks`` around someone else's training
step (a peer such as DeepSpeed) and counts the unique storages autograd holds, parameters
excluded, with their peak. A packed tensor is wrapped in a small holder whose release (when
autograd frees the saved variable) decrements the count, so recomputation during backward
shows up too. It does not see tensors a system keeps outside autograd (e.g. pipeline
buffers of stage inputs), which trainwright's own store does count.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch

__all__ = ["SavedTensorMeter"]


class _Held:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """Peak bytes of saved activations while :meth:`measure` is active.

    Args:
        exclude: modules whose parameters and buffers are not counted.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr()
                         for m in exclude for t in [*m.parameters(), *m.buffers()]}
        self._refs: dict = defaultdict(int)
        self._sizes: dict = {}
        self.bytes = 0
        self.peak_bytes = 0

    def _release(self, key) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.bytes -= self._sizes.pop(key)
            del self._refs[key]

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._exclude:
            return t
        if self._refs[key] == 0:
            self._sizes[key] = t.untyped_storage().nbytes()
            self.bytes += self._sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._refs[key] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    @contextmanager
    def measure(self):
        """Count saved tensors created inside the body (and released at any later time)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
