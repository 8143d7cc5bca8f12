"""Per-layer working sets measured during profiling: the footprint model's activation terms.

:class:`WorkingSetProbe` is a ``TorchDispatchMode`` that counts every storage an op creates
(parameters excluded) until it is freed, like the benchmarks' live-storage meter, so the
terms it measures are in the meter's own units. Around each layer's forward it records the
highest bytes alive at once that the layer created (``work``) and what is still alive when
the forward returns (``kept``: saved for backward plus output); see
:mod:`trainwright.plan.footprint`. :meth:`WorkingSetProbe.measure_split` runs a layer's
forward again under a split backward's ``B`` and counts what ``B`` leaves for ``W``.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainwright.pipeline.deferred_linear import WeightStash, defer_linears
from trainwright.pipeline.split_backward import backward_input, backward_weight
from trainwright.pipeline.store import as_tuple
from trainwright.pipeline.swap import HostSwap

__all__ = ["WorkingSetProbe"]


def _in_host_copy() -> bool:
    """Whether the op being dispatched was called from a host swap's copy
    (:meth:`~trainwright.pipeline.swap.HostSwap.pack` on the Python stack)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is HostSwap.pack.__code__:
            return True
        f = f.f_back
    return False


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
        self.swapped: dict[int, tuple[int, int]] = {}
        """layer -> (work, kept) of its forward with its saved tensors swapped to the host
        (:meth:`measure_swapped`): device bytes only."""
        self._swapping = False
        """Inside :meth:`measure_swapped`: storages a host swap's copy creates are not
        counted (told apart by where they are allocated, as the live meter does)."""
        self.split: dict[int, tuple[int, bool]] = {}
        """layer -> (bytes its forward created that a split backward's ``B`` leaves for
        ``W``, whether ``B`` left its input alive too): :meth:`measure_split`."""
        self.split_s: dict[int, tuple[float, float]] = {}
        """layer -> seconds of that split backward's ``B`` and ``W`` (one run, warm)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage())
        return out

    def _add(self, st) -> None:
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self.exclude or key in self._live or (
                self._swapping and _in_host_copy()):
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

    def measure_swapped(self, layer: int, run):
        """Run ``run()`` (one layer's forward whose saved tensors the store swaps to the host)
        and record its device ``(work, kept)`` in :attr:`swapped`, the host copies left
        uncounted; returns its result."""
        base, self.peak, self._swapping = self.bytes, self.bytes, True
        try:
            out = run()
        finally:
            self._swapping = False
        self.swapped[layer] = (self.peak - base, self.bytes - base)
        return out

    def measure_split(self, layer: int, module: nn.Module, inp: tuple,
                      loss: Callable | None = None, defer: bool = True) -> None:
        """Run ``module`` on a copy of ``inp`` as a pipeline stage past the first does under a
        zero-bubble schedule (its linear layers deferred when ``defer``, as the stage's
        :meth:`~trainwright.pipeline.stage.Stage._stash` decides), its ``B``
        (:func:`~trainwright.pipeline.split_backward.backward_input`), and record in
        :attr:`split` what is still alive of what the forward created, then its ``W`` (the
        two passes' times in :attr:`split_s`).

        ``loss``: the stage's loss on the layer's first output (the model's last layer), or
        None (``B`` starts from a gradient of ones). Call it outside the mode (the forward
        enters it; ``B``'s own tensors are gradients, which the meter does not count)."""
        leaves = tuple(t.detach().clone().requires_grad_(t.is_floating_point())
                       if isinstance(t, torch.Tensor) else t for t in inp)
        # the input as a layer inside a stage's segment gets it, a tensor of the graph: a
        # leaf would be kept by autograd's gradient accumulator for as long as any node
        # above it lives (a stashed tensor's), whether or not W reads it
        xs = tuple(t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t
                   for t in leaves)
        alive = [x.is_floating_point() for x in xs if isinstance(x, torch.Tensor)][:1] or [False]
        if alive[0]:
            weakref.finalize(xs[0].untyped_storage(), alive.__setitem__, 0, False)
        stash = WeightStash() if defer else None
        base = self.bytes
        with self, defer_linears(module, stash) if stash is not None else nullcontext():
            outs = as_tuple(module(xs[0] if len(xs) == 1 else xs))
            if loss is not None:
                outs = (loss(outs[0]),)
        grads = None if loss is not None else tuple(
            torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
            for o in outs)
        params = [q for q in module.parameters() if q.requires_grad]
        device = next((x.device for x in xs if isinstance(x, torch.Tensor)), None)
        t0 = _now(device)
        _, work = backward_input(outs, grads, xs, params, stash)
        b_s = _now(device) - t0
        del outs, grads, _
        for x in xs:
            if isinstance(x, torch.Tensor):
                x.grad = None
        del xs, x, leaves
        self.split[layer] = (self.bytes - base, alive[0])
        t0 = _now(device)
        backward_weight(work)
        self.split_s[layer] = (b_s, _now(device) - t0)


def _now(device: torch.device | None) -> float:
    """The wall clock once ``device`` has finished its queued work (CUDA runs
    asynchronously; the host needs no wait)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
