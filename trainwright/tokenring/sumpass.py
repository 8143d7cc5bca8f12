"""The closed sum's pass around the ring: chunks, and their reassembly on each member.

The node that closes a step holds the step's sum (it travelled with the token, each
contributor adding its gradient, :func:`fold`). It cuts the sum into chunks of at most
``CHUNK_BYTES`` (:func:`chunk_plan`) and sends them to its successor; every member stores
each chunk (:class:`SumAssembly`) and forwards it at once to its own successor, until the
chunk is back at the closer's predecessor. Chunks pipeline: the first reaches the far end
while the closer still sends the last, so the pass takes about one sum's transfer time plus
one chunk's per hop, and each member sends the sum once, whatever the ring's size.

Pure tensor bookkeeping: no sockets (the ring sends), no threads.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK_BYTES", "chunk_plan", "fold", "SumAssembly", "layout_of"]

CHUNK_BYTES = 256 * 1024
"""Largest chunk of the sum's pass (small enough to pipeline, large enough that a chunk's
header and per-message cost stay negligible)."""


def fold(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The running sum in the token's order: ``((g0 + g1) + g2) + ...``, the same float
    operations as the token performs hop by hop (a member that rebuilds a lost sum from the
    contributions gets it bit for bit)."""
    acc = list(grads[0])
    for g in grads[1:]:
        acc = [a + b for a, b in zip(acc, g, strict=True)]
    return acc


def layout_of(tensors: list[torch.Tensor]) -> list[list]:
    """``[[shape, dtype name], ...]`` of the sum (what a receiver allocates)."""
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]


def chunk_plan(layout: list[list], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int, int]]:
    """Chunks of a sum with ``layout``: ``(tensor index, first element, end element)``,
    each at most ``chunk_bytes`` (a tensor never shares a chunk with another)."""
    out = []
    for ti, (shape, dtype) in enumerate(layout):
        n = math.prod(shape)
        per = max(1, chunk_bytes // getattr(torch, dtype).itemsize)
        out.extend((ti, lo, min(n, lo + per)) for lo in range(0, n, per))
        if n == 0:
            out.append((ti, 0, 0))
    return out


def chunk_tensor(tensors: list[torch.Tensor], piece: tuple[int, int, int]) -> torch.Tensor:
    """The flat slice ``piece`` of ``tensors`` (a view, no copy)."""
    ti, lo, hi = piece
    return tensors[ti].detach().reshape(-1)[lo:hi]


class SumAssembly:
    """One step's sum being received chunk by chunk.

    Args:
        layout: ``[[shape, dtype name], ...]`` from :func:`layout_of`.
        chunk_bytes: the sender's chunk size (the plan must match).
    """

    def __init__(self, layout: list[list], chunk_bytes: int = CHUNK_BYTES):
        self.plan = chunk_plan(layout, chunk_bytes)
        self.tensors = [torch.empty(shape, dtype=getattr(torch, dt)) for shape, dt in layout]
        self.got: set[int] = set()

    def add(self, k: int, data: torch.Tensor) -> bool:
        """Store chunk ``k``; returns False if it was here already."""
        if k in self.got:
            return False
        ti, lo, hi = self.plan[k]
        if data.numel() != hi - lo:
            raise ValueError(f"chunk {k} of the sum has {data.numel()} elements, expected "
                             f"{hi - lo}: sender and receiver disagree on the chunk plan")
        self.tensors[ti].view(-1)[lo:hi].copy_(data.reshape(-1))
        self.got.add(k)
        return True

    @property
    def complete(self) -> bool:
        """Every chunk arrived."""
        return len(self.got) == len(self.plan)
