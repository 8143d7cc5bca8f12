"""Host swap of saved activations, through ``torch.autograd.graph.saved_tensors_hooks``.

``pack`` runs when autograd saves a tensor during forward: the tensor is copied to host
memory and the device copy is released as soon as autograd drops it. ``unpack`` runs when
backward needs it. On CUDA the copies go to pinned buffers on a side stream (so they
overlap compute) and :meth:`HostSwap.prefetch` starts the copy back one layer ahead; on
CPU the "device" is host memory too, so the copy is a real one into a separate buffer
that the store counts as host bytes, not device bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    @property
    def nbytes(self) -> int:
        """Bytes held on the host."""
        return self.host.numel() * self.host.element_size()


class HostSwap:
    """Copies saved tensors to host memory and back.

    Args:
        device: the compute device of the stage.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def pack(self, t: torch.Tensor) -> Swapped:
        """Copy ``t`` to the host; the caller returns the result from the pack hook."""
        if not self.cuda:
            return Swapped(t.detach().clone())
        if not t.is_cuda:  # already in host memory: nothing to move (record_stream is CUDA's)
            return Swapped(t.detach(), returns_to_device=False)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # keep t's memory until the copy has read it
        return Swapped(host)

    def prefetch(self, s: Swapped) -> None:
        """Start copying ``s`` back to the device (no-op on CPU or if already started)."""
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
        self.prefetch(s)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(s.ready)
        s.device_copy.record_stream(current)
        return s.device_copy
