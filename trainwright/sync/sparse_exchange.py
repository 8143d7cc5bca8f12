"""One exchange of row-sparse gradients over a group: the collectives and their buffers.

:func:`gather_counts` all-gathers every rank's row counts (and whatever else the caller
agrees on with them); :func:`gather_counts_with_rows` does it in the same collective as one
parameter's ``allgather`` transfer, each rank's rows padded to a capacity agreed
beforehand (:func:`carried_sum` then sums them); :func:`exchange` sums every rank's triple
along one path: ``allgather`` (each rank's rows and ids as one flat block, padded to the
largest count), ``broadcast`` (one per rank that has rows) or ``dense`` (a touched-row
mark, then the union's rows all-reduced in place as one block). Which path, and when, is
:class:`~trainwright.sync.sparse.SparseGradSync`'s choice; the triple itself lives in
:mod:`trainwright.sync.rowsparse`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll
from trainwright.sync.rowsparse import (
    LocalRows,
    RowSparse,
    _id_slots,
    _merge,
    _pack,
    _unpack,
    union_slots,
)
from trainwright.sync.sparse_cost import all_gather_into

__all__ = ["EXCHANGE_PATHS", "gather_counts", "gather_counts_with_rows", "carried_sum",
           "exchange", "global_rank"]

EXCHANGE_PATHS = ("allgather", "broadcast", "dense")
"""The ways :func:`exchange` can sum the triples."""


def _group_rank(group) -> int:
    return dist.get_rank(group)


def global_rank(group, r: int) -> int:
    """The default group's rank of ``group``'s rank ``r``."""
    return r if group is None else dist.get_global_rank(group, r)


def gather_counts(local: list[int], group=None, device=None) -> torch.Tensor:
    """All-gather a list of int64 from every rank: ``(world, len(local))`` on the CPU.

    ``device`` is where the collective runs (CUDA for NCCL; default CPU for gloo).
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(local, dtype=torch.int64, device=device)
    out = torch.empty(world * len(local), dtype=torch.int64, device=device)
    all_gather_into(out, mine, group=group)
    return out.view(world, len(local)).cpu()


def gather_counts_with_rows(local: list[int], t: RowSparse | None, capacity: int, *,
                            row_shape: tuple[int, ...], dtype: torch.dtype, group=None,
                            device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_counts` of ``local`` and the ``allgather`` path's transfer of ``t`` in
    one collective.

    On a loaded host a collective's latency is most of a small exchange's time (4 gloo
    ranks on 2 cores: 3.6 ms for 12 integers, 4.3 ms for 640 KB of rows), so the counts
    ride in front of the rows. Each rank's block is ``local`` (int64, its bytes as values),
    then ``capacity`` rows as :func:`~trainwright.sync.rowsparse._pack` lays them out; every
    rank must pass the same ``capacity``, ``row_shape`` and ``dtype`` (agreed from earlier
    steps), so that the blocks are equal. A rank with more rows than ``capacity`` (or none:
    ``t`` None) sends padding, and its count, gathered here, tells everyone.

    Returns:
        ``(world, len(local))`` counts on the CPU, and ``(world, capacity * per_row)`` rows
        for :func:`carried_sum` (valid where every count fits ``capacity``).
    """
    world = dist.get_world_size(group)
    dev = device if device is not None else (t.values.device if t is not None else None)
    head = torch.tensor(local, dtype=torch.int64, device=dev).view(dtype)
    per_row = math.prod(row_shape) + _id_slots(dtype)
    if t is not None and t.count <= capacity:
        rows = _pack(t, capacity)
    else:
        rows = torch.zeros(capacity * per_row, dtype=dtype, device=dev)
    mine = torch.cat([head, rows])
    recv = torch.empty(world * mine.numel(), dtype=dtype, device=dev)
    all_gather_into(recv, mine, group=group)
    parts = recv.view(world, mine.numel())
    counts = parts[:, : head.numel()].clone().view(torch.int64).cpu()
    return counts, parts[:, head.numel():]


def carried_sum(rows: torch.Tensor, capacity: int, counts: list[int], height: int,
                row_shape: tuple[int, ...]) -> RowSparse:
    """Sum the blocks :func:`gather_counts_with_rows` carried (every count at most
    ``capacity``), as :func:`exchange`'s ``allgather`` path does (not yet divided)."""
    if max(counts) > capacity:
        raise ValueError(f"a rank has {max(counts)} rows, more than the capacity {capacity}")
    blocks = [_unpack(rows[r], capacity, c, row_shape) for r, c in enumerate(counts) if c]
    return _merge(blocks, height, row_shape)


def exchange(t: RowSparse | LocalRows, counts: list[int], path: str, group=None,
             buffer: torch.Tensor | None = None) -> RowSparse:
    """Sum every rank's triple over ``group`` along ``path`` (not yet divided by the size).

    Args:
        t: this rank's triple (or :class:`LocalRows`, summed here only if the path needs it).
        counts: every rank's valid rows (from :func:`gather_counts`); storage for the
            received rows is sized from them before any transfer starts.
        path: ``"allgather"``, ``"broadcast"`` or ``"dense"``.
        group: the data-parallel group.
        buffer: a reusable table-sized buffer for the ``dense`` path (see _exchange_dense).

    Returns:
        The summed triple, sorted unique rows, on every rank.
    """
    world, me = dist.get_world_size(group), _group_rank(group)
    if counts[me] != t.count:
        raise ValueError(f"rank {me} has {t.count} rows but the gathered count says {counts[me]}")
    local = LocalRows(t) if isinstance(t, RowSparse) else t
    if path == "dense":
        return _exchange_dense(local, group, buffer)
    t = local.triple()
    dtype, dev = t.values.dtype, t.values.device
    per_row = math.prod(t.row_shape) + _id_slots(dtype)
    if path == "allgather":
        top = max(counts)  # equal counts: no padding at all
        recv = torch.empty(world * top * per_row, dtype=dtype, device=dev)
        all_gather_into(recv, _pack(t, top), group=group)
        parts = recv.view(world, top * per_row)
        blocks = [_unpack(parts[r], top, c, t.row_shape) for r, c in enumerate(counts) if c]
    elif path == "broadcast":
        senders = [r for r, c in enumerate(counts) if c]
        # every buffer is sized from the gathered counts before the first transfer
        bufs = [_pack(t, counts[r]) if r == me else
                torch.empty(counts[r] * per_row, dtype=dtype, device=dev) for r in senders]
        works = [coll.broadcast(buf, src=global_rank(group, r), group=group, async_op=True)
                 for r, buf in zip(senders, bufs, strict=True)]
        for w in works:
            w.wait()
        blocks = [_unpack(buf, counts[r], counts[r], t.row_shape)
                  for r, buf in zip(senders, bufs, strict=True)]
    else:
        raise ValueError(f"unknown sparse sync path {path!r}; choose one of {EXCHANGE_PATHS}")
    return _merge(blocks, t.height, t.row_shape)


def _exchange_dense(local: LocalRows, group, buffer: torch.Tensor | None = None) -> RowSparse:
    """All-reduce a touched-row mark, then the union of touched rows as one dense block.

    [Note: the dense path costs one plain all-reduce]
    The mark (one byte per table row, 1/256 of a 64-wide fp32 table) goes first, so every
    rank knows the union of touched rows before filling anything. Each rank then adds its
    raw ids' values (duplicates summed on the way by ``scatter_add_``) straight into the
    block that is all-reduced in place, divided in place, and handed back as the gradient's
    values: no triple is built, nothing is copied after the collective, and untouched rows
    are never sent. When the union is the whole table the block is the table-sized buffer
    itself, so the collective is exactly the plain dense all-reduce of the table.

    ``buffer`` (a flat tensor, overwritten) saves allocating the table-sized block every
    step: on CPU a fresh one costs a page fault per 4 KiB. The result's values are a prefix
    of it, so it may only be reused once the gradient built from it is gone.
    """
    width = math.prod(local.row_shape)
    mark = torch.zeros(local.height, dtype=torch.uint8, device=local.device)
    local.mark(mark)
    coll.all_reduce(mark, op=dist.ReduceOp.MAX, group=group)
    rows = mark.nonzero().squeeze(1)
    n = rows.numel()
    slot = union_slots(mark) if n < local.height else None
    need = local.height * width
    if buffer is None or buffer.numel() < need or buffer.dtype != local.dtype:
        buffer = torch.empty(need, dtype=local.dtype, device=local.device)
    block = buffer[: n * width].view(n, width)
    block.zero_()
    local.scatter_into(block, slot)
    coll.all_reduce(block, group=group)
    return RowSparse(rows, local.height, block.view(n, *local.row_shape))
