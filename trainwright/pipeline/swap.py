"""Host swap of saved activations, through ``torch.autograd.graph.saved_tensors_hooks``.

``pack`` runs when autograd saves a tensor during forward: the tensor is copied to host
memory and the device copy is released as soon as autograd drops it. ``unpack`` runs when
backward needs it. On CUDA the copies go to pinned buffers on a side stream (so they
overlap compute) and :meth:`HostSwap.prefetch` starts the copy back one layer ahead; on
CPU the "device" is host memory too, so the copy is a real one into a separate buffer
that the store counts as host bytes, not device bytes.

One layer's forward often saves the same memory twice (attention saves its output, and the
projection after it a reshaped view of it): with the layer's ``copies`` table, the second
is a view of the first one's host copy, so the memory is copied (and held) once.

On the CPU each copy's thread CPU time is counted (:meth:`HostSwap.take_copies`): what the
copies cost the rank's own thread, apart from the time other ranks held the cores, so
that a run's copies can be compared with the same copies in one process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import cache

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Swapped", "HostSwap"]


@dataclass
class Swapped:
    """A saved tensor that lives on the host until backward."""

    host: torch.Tensor
    device_copy: torch.Tensor | None = None
    ready: object = None
    """CUDA event marking the end of the copy back (None on CPU)."""
    returns_to_device: bool = True
    """False for a tensor that already lived on the host (token ids saved on a CUDA
    stage): backward gets it back as it was, with no copy."""
    base: Swapped | None = None
    """The copy of the same memory saved earlier in the layer: ``host`` is a view of its
    host copy, and backward gets a view of its tensor (no bytes of its own)."""

    @property
    def nbytes(self) -> int:
        """Bytes held on the host (0 for a view of an earlier copy)."""
        return 0 if self.base is not None else self.host.numel() * self.host.element_size()


class HostSwap:
    """Copies saved tensors to host memory and back.

    Args:
        device: the compute device of the stage.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copy_cpu_s = 0.0
        """Thread CPU seconds of the CPU copies since :meth:`take_copies` (0 on CUDA)."""
        self.copied_bytes = 0
        """Bytes of those copies."""

    def take_copies(self) -> tuple[float, int]:
        """``(thread CPU seconds, bytes)`` of the CPU copies since the last call. The
        calling thread's CPU only: with several intra-op threads a large copy's share on the
        others is not counted (the planner's runs and profile use one thread per rank)."""
        out = (self.copy_cpu_s, self.copied_bytes)
        self.copy_cpu_s, self.copied_bytes = 0.0, 0
        return out

    def pack(self, t: torch.Tensor, copies: dict | None = None) -> Swapped:
        """Copy ``t`` to the host; the caller returns the result from the pack hook.

        ``copies``: the layer's table of memory already copied (one dict per forward); a
        tensor over exactly the memory of an earlier one becomes a view of its copy."""
        region = _region(t) if copies is not None else None
        earlier = copies.get(region) if region is not None else None
        if earlier is not None and not earlier[0].expired():
            base = earlier[1]
            return Swapped(base.host.as_strided(t.shape, t.stride()), base=base,
                           returns_to_device=base.returns_to_device)
        s = self._copy(t)
        if region is not None and s.host.stride() == t.stride():
            copies[region] = (StorageWeakRef(t.untyped_storage()), s)
        return s

    def _copy(self, t: torch.Tensor) -> Swapped:
        if not self.cuda:
            t0 = time.thread_time()
            host = t.detach().clone()  # dense tensors keep their strides
            self.copy_cpu_s += max(0.0, time.thread_time() - t0 - _clock_pair_s())
            self.copied_bytes += host.numel() * host.element_size()
            return Swapped(host)
        if not t.is_cuda:  # already in host memory: nothing to move (record_stream is CUDA's)
            return Swapped(t.detach(), returns_to_device=False)
        host = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
                if _dense(t) else
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # keep t's memory until the copy has read it
        return Swapped(host)

    def prefetch(self, s: Swapped) -> None:
        """Start copying ``s`` back to the device (no-op on CPU or if already started)."""
        if s.base is not None:
            return self.prefetch(s.base)
        if not self.cuda or not s.returns_to_device or s.device_copy is not None:
            return
        with torch.cuda.stream(self.stream):
            s.device_copy = s.host.to(self.device, non_blocking=True)
            s.ready = torch.cuda.Event()
            s.ready.record(self.stream)

    def unpack(self, s: Swapped) -> torch.Tensor:
        """The tensor back on the device, for the backward that needs it."""
        if not self.cuda or not s.returns_to_device:
            return s.host
        if s.base is not None:  # the earlier copy's tensor, viewed as this one was
            return self.unpack(s.base).as_strided(s.host.shape, s.host.stride())
        self.prefetch(s)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(s.ready)
        s.device_copy.record_stream(current)
        return s.device_copy


@cache
def _clock_pair_s() -> float:
    """Thread CPU seconds between two back-to-back ``time.thread_time()`` calls (a system
    call each, ~0.6 us here against 4-10 us for a 128 KiB copy): taken off each copy's."""
    pairs = []
    for _ in range(64):
        t0 = time.thread_time()
        pairs.append(time.thread_time() - t0)
    return statistics.median(pairs)


def _region(t: torch.Tensor) -> tuple | None:
    """The memory ``t`` covers, when it covers it exactly (dense, no overlap): two tensors
    with one region hold the same elements, however they are shaped."""
    if not _dense(t):
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype, t.device)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory, each once (a permuted contiguous
    tensor): ordered by stride, each dimension steps over all the ones before it."""
    step = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)
                               if sz != 1):
        if stride != step:
            return False
        step *= size
    return True
