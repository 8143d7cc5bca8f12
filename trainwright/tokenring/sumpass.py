"""The closed sum's pass around the ring: chunks, and their reassembly on each member.

The node that closes a step holds the step's sum (it travelled with the token, each
contributor adding its gradient, :func:`fold`). It cuts the sum into chunks of at most
``CHUNK_BYTES`` (:func:`chunk_plan`) and sends them to its successor; every member stores
each chunk (:class:`SumAssembly`) and forwards it at once the way it came, until the chunk
reaches the route's last member, the closer's predecessor. Chunks pipeline: the first
reaches the far end while the closer still sends the last, so the pass takes about one
sum's transfer time plus one chunk's per hop, and each member sends the sum once, whatever
the ring's size. A sum of few chunks on a long ring goes both ways round instead, to the
successor and to the predecessor, each route half-way (:func:`pass_routes`): half the hops,
the closer sending the sum twice (it sent no running sum).

Pure tensor bookkeeping: no sockets (the ring sends), no threads.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK_BYTES", "chunk_plan", "chunk_tensors", "fold", "SumAssembly", "SumBuffers",
           "layout_of", "pass_routes"]

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


def pass_routes(order: list[int], closer: int, chunks: int) -> list[tuple[int, int, int]]:
    """The closed sum's routes from ``closer`` round a ring of members ``order``:
    ``(first member, direction, last member)``, direction 1 along the successors, -1 along
    the predecessors; together they reach every other member once.

    Both ways round (the longer route ``ceil((n - 1) / 2)`` hops) when the sum has at most
    ``floor((n - 1) / 2)`` chunks, else one way (``n - 1`` hops). The closer's link carries
    each chunk once per route: two routes save ``floor((n - 1) / 2)`` hops' latency and
    cost ``chunks`` more chunk sends, so with at most that many chunks they are never
    slower (a hop costs at least a send), and a large sum keeps the one-way pass its link
    bandwidth is best spent on. None for a ring of one.
    """
    n = len(order)
    i = order.index(closer)
    ahead = math.ceil((n - 1) / 2) if chunks <= (n - 1) // 2 else n - 1
    behind = n - 1 - ahead
    routes = [(order[(i + 1) % n], 1, order[(i + ahead) % n])] if ahead else []
    if behind:
        routes.append((order[(i - 1) % n], -1, order[(i - behind) % n]))
    return routes


def layout_of(tensors: list[torch.Tensor]) -> list[list]:
    """``[[shape, dtype name], ...]`` of the sum (what a receiver allocates)."""
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]


def chunk_plan(layout: list[list],
               chunk_bytes: int = CHUNK_BYTES) -> list[list[tuple[int, int, int]]]:
    """Chunks of a sum with ``layout``, in order: each a list of pieces ``(tensor index,
    first element, end element)`` of at most ``chunk_bytes`` in all (one element at least).
    A large tensor is cut across chunks, small ones share one (a layer's bias rides with
    the end of its weight), so a sum of ``B`` bytes is about ``ceil(B / chunk_bytes)``
    messages, as the model of scale counts them. (Until 2026-12-07 a tensor never shared a
    chunk: the benchmark's 1.2 MB MLP went in 9 messages instead of 5, and the 8-node row's
    330 KB in 6 instead of 2, too many to go both ways round: 7 hops instead of 4.)"""
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = chunk_bytes
    for ti, (shape, dtype) in enumerate(layout):
        n, size = math.prod(shape), getattr(torch, dtype).itemsize
        if n == 0:
            cur.append((ti, 0, 0))
        lo = 0
        while lo < n:
            fit = room // size
            if fit == 0 and cur:
                chunks.append(cur)
                cur, room = [], chunk_bytes
                continue
            hi = min(n, lo + max(1, fit))
            cur.append((ti, lo, hi))
            room -= (hi - lo) * size
            lo = hi
    if cur:
        chunks.append(cur)
    return chunks


def chunk_tensors(tensors: list[torch.Tensor],
                  chunk: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The flat slices of ``tensors`` a chunk holds, one per piece (views, no copy)."""
    return [tensors[ti].detach().reshape(-1)[lo:hi] for ti, lo, hi in chunk]


class SumBuffers:
    """Tensors of sums this member no longer keeps, handed to the next sums it assembles.

    Every step a member receives one sum; written into memory fresh from the allocator, each
    chunk's copy first faults its pages in: on the 2-core benchmark host a 256 KiB chunk's
    copy then took a median 0.05 ms of CPU but 0.9 ms at the 90th percentile (0.19 ms with
    the C allocator told to keep freed memory), on the pass's critical path at every hop.
    A sum leaves :attr:`~trainwright.tokenring.ring.TokenRing.sums` ``RETAIN_STEPS`` steps
    after it was applied; its tensors, already touched, take the place of fresh ones.

    Only tensors nothing else references may be given back: the ring gives back the sums
    it assembled itself, which it never sends without a copy (a fetch's answer is cloned).

    Args:
        keep: most tensor lists kept per layout (more are freed).
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}

    @staticmethod
    def _key(layout: list[list]) -> tuple:
        return tuple((tuple(shape), dt) for shape, dt in layout)

    def take(self, layout: list[list]) -> list[torch.Tensor]:
        """Tensors for a sum of ``layout``: kept ones where there are, else new."""
        kept = self._free.get(self._key(layout))
        if kept:
            return kept.pop()
        return [torch.empty(shape, dtype=getattr(torch, dt)) for shape, dt in layout]

    def give(self, tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` (a sum nothing else references any more) for a later :meth:`take`."""
        kept = self._free.setdefault(self._key(layout_of(tensors)), [])
        if len(kept) < self.keep:
            kept.append(tensors)

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())


class SumAssembly:
    """One step's sum being received chunk by chunk.

    Args:
        layout: ``[[shape, dtype name], ...]`` from :func:`layout_of`.
        chunk_bytes: the sender's chunk size (the plan must match).
        buffers: where its tensors come from (default: new ones).
    """

    def __init__(self, layout: list[list], chunk_bytes: int = CHUNK_BYTES,
                 buffers: SumBuffers | None = None):
        self.plan = chunk_plan(layout, chunk_bytes)
        self.tensors = (buffers or SumBuffers(keep=0)).take(layout)
        self.got: set[int] = set()

    def add(self, k: int, pieces: list[torch.Tensor]) -> bool:
        """Store chunk ``k`` (its pieces, in order); returns False if it was here already."""
        if k in self.got:
            return False
        plan = self.plan[k]
        got = [p.numel() for p in pieces]
        if got != [hi - lo for _, lo, hi in plan]:
            raise ValueError(f"chunk {k} of the sum has pieces of {got} elements, expected "
                             f"{[hi - lo for _, lo, hi in plan]}: sender and receiver disagree "
                             f"on the chunk plan")
        for (ti, lo, hi), data in zip(plan, pieces, strict=True):
            self.tensors[ti].view(-1)[lo:hi].copy_(data.reshape(-1))
        self.got.add(k)
        return True

    @property
    def complete(self) -> bool:
        """Every chunk arrived."""
        return len(self.got) == len(self.plan)
