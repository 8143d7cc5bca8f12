"""Sparse gradient synchronisation as *rows + height + values* (seed 001).

An embedding table touched by a few thousand ids out of millions has a gradient that is
almost all zeros. :class:`RowSparse` keeps only the touched rows: the sorted, unique row
ids, the table's height and one value row per id (PaddlePaddle's SelectedRows). The
exchange over a data-parallel group is:

1. every rank sums its duplicate rows locally and all-gathers its row count (one small
   all-gather for all parameters of the call);
2. from the gathered counts every rank sizes the storage for everyone's rows before
   anything is received, and a :class:`LinkModel` (measured latency and bandwidth)
   picks the cheapest way: ``allgather`` (all counts equal: rows and values directly;
   unequal: padded to the largest), ``broadcast`` (one per rank that has rows), or
   ``dense`` (all-reduce of the full table when that is cheaper, e.g. at high density);
3. the gathered rows are summed into the target sparse gradient and divided by the group
   size, exactly like dense DDP averages.

Each rank's rows travel as one flat block, value rows then ids (each int64 id's bytes
reinterpreted as 1, 2 or 4 value elements), so each transfer is one collective and the
received values stay contiguous for the merge. A per-path correction factor, learned from
measured / predicted times and agreed through the count all-gather, keeps the model honest
at sizes the start-up calibration did not see.

:class:`SparseGradSync` is the :class:`~trainwright.sync.GradSync` strategy (pipeline dp
groups, ``sync.sparse = true``); :class:`SparseDataParallel` is the DDP-like wrapper for
plain data parallel. Both send every other parameter through
:class:`~trainwright.sync.dense.BucketedAllReduce`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainwright.sync import GradSync
from trainwright.sync.dense import BucketedAllReduce
from trainwright.sync.sparse_cost import ID_BYTES, LinkModel, PathChoice, all_gather_into, calibrate

__all__ = ["RowSparse", "LocalRows", "LinkModel", "PathChoice", "PATHS", "calibrate", "exchange",
           "SparseGradSync", "SparseDataParallel", "sparse_sync_from_config"]

log = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (the old name warns); same collective

PATHS = ("auto", "allgather", "broadcast", "dense")
"""Values of ``sync.sparse_path``: ``auto`` lets the cost model choose, the others force."""

_EXCHANGE_PATHS = ("allgather", "broadcast", "dense")


# --------------------------------------------------------------------------- the triple


@dataclass
class RowSparse:
    """A row-sparse tensor: ``values[i]`` is row ``rows[i]`` of a ``height``-row tensor.

    ``rows`` is int64, sorted and unique (duplicates are summed when the triple is built);
    ``values`` has shape ``(len(rows), *row_shape)``.
    """

    rows: torch.Tensor
    height: int
    values: torch.Tensor

    @property
    def count(self) -> int:
        """Number of valid rows."""
        return int(self.rows.numel())

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row."""
        return tuple(self.values.shape[1:])

    @classmethod
    def from_ids(cls, ids: torch.Tensor, values: torch.Tensor, height: int) -> RowSparse:
        """Build from possibly repeated row ids (int32 or int64), summing duplicate rows.

        Raises:
            ValueError: an id outside ``[0, height)`` or a length mismatch.
        """
        ids = ids.reshape(-1)
        if ids.numel() != values.shape[0]:
            raise ValueError(f"{ids.numel()} row ids but {values.shape[0]} value rows")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= height):
            raise ValueError(f"row ids must lie in [0, {height}); got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        rows, vals = _sum_duplicates(ids.to(torch.int64), values, height)
        return cls(rows, height, vals)

    @classmethod
    def from_coo(cls, grad: torch.Tensor) -> RowSparse:
        """Build from a sparse COO gradient with one sparse dimension (``Embedding(sparse=True)``).

        Raises:
            TypeError: not a COO tensor with ``sparse_dim() == 1``.
        """
        if grad.layout != torch.sparse_coo or grad.sparse_dim() != 1:
            raise TypeError(f"expected a sparse COO tensor with one sparse dimension, got "
                            f"layout {grad.layout}" + (f" with sparse_dim {grad.sparse_dim()}"
                                                       if grad.is_sparse else ""))
        height = grad.shape[0]
        if grad.is_coalesced():
            return cls(grad.indices()[0], height, grad.values())
        # uncoalesced internals: our duplicate sum is cheaper than coalesce() (no full sort)
        return cls.from_ids(grad._indices()[0], grad._values(), height)

    @classmethod
    def from_dense(cls, grad: torch.Tensor) -> RowSparse:
        """Build from a dense gradient of an embedding-like parameter: rows with any non-zero."""
        flat = grad.reshape(grad.shape[0], -1)
        rows = flat.ne(0).any(dim=1).nonzero().squeeze(1)
        return cls(rows, grad.shape[0], grad.index_select(0, rows))

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> RowSparse:
        """No rows (a rank whose batch did not touch the table)."""
        return cls(torch.empty(0, dtype=torch.int64, device=device), shape[0],
                   torch.empty((0, *shape[1:]), dtype=dtype, device=device))

    def to_dense(self) -> torch.Tensor:
        """The full ``(height, *row_shape)`` tensor."""
        out = self.values.new_zeros((self.height, *self.row_shape))
        out.index_copy_(0, self.rows, self.values)
        return out

    def to_coo(self) -> torch.Tensor:
        """A coalesced sparse COO tensor (what ``nn.Embedding(sparse=True)`` gradients are)."""
        return torch.sparse_coo_tensor(self.rows.unsqueeze(0), self.values,
                                       (self.height, *self.row_shape), is_coalesced=True,
                                       check_invariants=False)


def _unique_rows(ids: torch.Tensor, height: int):
    """``(count, plan)``: distinct ids, and what :func:`_sum_duplicates` reuses to sum them."""
    if ids.numel() * 16 < height:  # few ids: sorting them beats a pass over the table
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return rows.numel(), (rows, inverse)
    mark = torch.zeros(height, dtype=torch.bool, device=ids.device)  # many: a bitmap, no sort
    mark[ids] = True
    return int(mark.count_nonzero()), mark


def _rows_and_inverse(ids: torch.Tensor, height: int, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique rows and each id's position among them, from a ``_unique_rows`` plan."""
    if isinstance(plan, tuple):
        return plan
    rows = plan.nonzero().squeeze(1)
    slot = torch.empty(height, dtype=torch.int64, device=ids.device)
    slot[rows] = torch.arange(rows.numel(), device=ids.device)
    return rows, slot[ids]


def _sum_duplicates(ids: torch.Tensor, values: torch.Tensor, height: int,
                    plan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ids and the summed value row of each."""
    if ids.numel() == 0:
        return ids, values
    if plan is None:
        _, plan = _unique_rows(ids, height)
    rows, inverse = _rows_and_inverse(ids, height, plan)
    if rows.numel() == ids.numel():  # no duplicates: a permutation
        out = torch.empty_like(values)
        out[inverse] = values
        return rows, out
    out = values.new_zeros((rows.numel(), *values.shape[1:]))
    out.index_add_(0, inverse, values)
    return rows, out


class LocalRows:
    """One rank's rows of one gradient: counted at once, duplicates summed only if needed.

    The dense path never needs the summed triple: raw ids and values are scattered
    straight into the all-reduce buffer (``index_add_`` sums duplicates on the way).
    """

    def __init__(self, triple: RowSparse | None = None, ids: torch.Tensor | None = None,
                 values: torch.Tensor | None = None, height: int = 0):
        self._triple, self._ids, self._values, self._plan = triple, ids, values, None
        if triple is not None:
            self.height, self.row_shape, self.count = triple.height, triple.row_shape, triple.count
            self.dtype, self.device = triple.values.dtype, triple.values.device
        else:
            self.height, self.row_shape = height, tuple(values.shape[1:])
            self.dtype, self.device = values.dtype, values.device
            self.count, self._plan = _unique_rows(ids, height)

    @classmethod
    def of(cls, p: torch.Tensor) -> LocalRows:
        """The rows of ``p.grad``: sparse COO, dense (touched rows detected) or None (no rows)."""
        g = p.grad
        if g is None:
            return cls(RowSparse.empty(tuple(p.shape), p.dtype, p.device))
        if not g.is_sparse:
            return cls(RowSparse.from_dense(g))
        if g.is_coalesced() or g.sparse_dim() != 1:
            return cls(RowSparse.from_coo(g))
        return cls(ids=g._indices()[0], values=g._values(), height=g.shape[0])

    def triple(self) -> RowSparse:
        """The triple with duplicates summed."""
        if self._triple is None:
            rows, vals = _sum_duplicates(self._ids, self._values, self.height, self._plan)
            self._triple = RowSparse(rows, self.height, vals)
            self._ids = self._values = self._plan = None
        return self._triple

    def scatter_into(self, dense: torch.Tensor, mark: torch.Tensor) -> None:
        """Add the rows into a ``(height, width)`` buffer and set their ``mark`` entries."""
        width = dense.shape[1]
        if self._triple is not None:
            t = self._triple
            dense.index_copy_(0, t.rows, t.values.reshape(t.count, width))
            mark.index_fill_(0, t.rows, 1)
        else:
            dense.index_add_(0, self._ids, self._values.reshape(self._ids.numel(), width))
            mark.index_fill_(0, self._ids, 1)


def _pack(t: RowSparse, n_rows: int) -> torch.Tensor:
    """Flat buffer for ``n_rows`` rows: ``n_rows`` value rows, then ``n_rows`` ids, each id's
    8 bytes as ``k`` value elements. Slots past ``t.count`` are padding, never read
    (receivers know every rank's count); each block stays contiguous for the merge."""
    k, width, n = _id_slots(t.values.dtype), math.prod(t.row_shape), t.count
    buf = torch.empty(n_rows * (width + k), dtype=t.values.dtype, device=t.values.device)
    buf[: n * width] = t.values.reshape(-1)
    buf[n_rows * width : n_rows * width + n * k] = t.rows.view(t.values.dtype)
    return buf


def _unpack(buf: torch.Tensor, n_rows: int, count: int,
            row_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the ids and value rows of one :func:`_pack` block holding ``count`` rows."""
    k, width = _id_slots(buf.dtype), math.prod(row_shape)
    # cloned: the ids are small, and a block may start at an offset int64 cannot view
    ids = buf[n_rows * width : n_rows * width + count * k].clone().view(torch.int64)
    return ids, buf[: count * width].view(count, *row_shape)


def _merge(blocks: list[tuple[torch.Tensor, torch.Tensor]], height: int,
           row_shape: tuple[int, ...]) -> RowSparse:
    """Sum every rank's (ids, values) block into one triple, block by block (no big copy)."""
    ids = torch.cat([b[0] for b in blocks])
    _, plan = _unique_rows(ids, height)
    rows, inverse = _rows_and_inverse(ids, height, plan)
    out = blocks[0][1].new_zeros((rows.numel(), *row_shape))
    offset = 0
    for block_ids, values in blocks:
        out.index_add_(0, inverse[offset : offset + block_ids.numel()], values)
        offset += block_ids.numel()
    return RowSparse(rows, height, out)


def _id_slots(dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    if not (dtype.is_floating_point or dtype.is_complex) or ID_BYTES % size:
        raise TypeError(f"sparse sync needs floating-point values of 2, 4 or 8 bytes, got {dtype}")
    return ID_BYTES // size


# --------------------------------------------------------------------------- exchange


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _global_rank(group, r: int) -> int:
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
        works = [dist.broadcast(buf, src=_global_rank(group, r), group=group, async_op=True)
                 for r, buf in zip(senders, bufs, strict=True)]
        for w in works:
            w.wait()
        blocks = [_unpack(buf, counts[r], counts[r], t.row_shape)
                  for r, buf in zip(senders, bufs, strict=True)]
    else:
        raise ValueError(f"unknown sparse sync path {path!r}; choose one of {PATHS[1:]}")
    return _merge(blocks, t.height, t.row_shape)


def _exchange_dense(local: LocalRows, group, buffer: torch.Tensor | None = None) -> RowSparse:
    """All-reduce the full table and a touched-row mark, then keep the touched rows.

    ``buffer`` (a ``(height, width)`` tensor, overwritten) saves allocating the table-sized
    buffer every step: on CPU a fresh one costs a page fault per 4 KiB. The result's values
    are a prefix of that buffer (touched rows compacted in place), so the buffer may only
    be reused once the gradient built from it is gone.
    """
    width = math.prod(local.row_shape)
    shape = (local.height, width)
    if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != local.dtype:
        buffer = torch.zeros(shape, dtype=local.dtype, device=local.device)
    else:
        buffer.zero_()
    mark = torch.zeros(local.height, dtype=torch.uint8, device=local.device)
    local.scatter_into(buffer, mark)
    works = [dist.all_reduce(buffer, group=group, async_op=True),
             dist.all_reduce(mark, op=dist.ReduceOp.MAX, group=group, async_op=True)]
    for w in works:
        w.wait()
    rows = mark.nonzero().squeeze(1)
    _compact_rows(buffer, rows)
    return RowSparse(rows, local.height, buffer[: rows.numel()].view(rows.numel(),
                                                                     *local.row_shape))


def _compact_rows(buf: torch.Tensor, rows: torch.Tensor, chunk: int = 4096) -> None:
    """Move ``buf[rows]`` to ``buf[:len(rows)]`` in place (``rows`` sorted ascending).

    Safe chunk by chunk: output row ``i`` reads row ``rows[i] >= i``, and a chunk only
    overwrites rows below every row a later chunk reads.
    """
    n = rows.numel()
    if n == buf.shape[0]:
        return  # every row touched: already in place
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        buf[i:j] = buf.index_select(0, rows[i:j])


# --------------------------------------------------------------------------- strategy


class SparseGradSync(GradSync):
    """Average gradients over a group: row-sparse parameters as triples, the rest dense.

    A parameter goes the sparse way when its gradient is a sparse COO tensor or it is the
    weight of an ``nn.Embedding`` / ``nn.EmbeddingBag`` registered with :meth:`watch`
    (dense gradients: touched rows are detected). Ranks agree on this through the count
    all-gather; a parameter that is sparse on some ranks only goes dense everywhere.

    Args:
        group: the data-parallel group (None: the default group).
        world: its size; with 1 nothing is sent.
        bucket_bytes: bucket size of the dense all-reduce of the other parameters.
        path: ``"auto"`` (cost model) or a forced path from :data:`PATHS`.
        link: the cost model; None = :func:`calibrate` at the first sync.
        link_overrides: constants that replace measured ones (``latency_s``, ...; 0 = measure).
    """

    def __init__(self, group, world: int, bucket_bytes: int = 25 * 2**20, *, path: str = "auto",
                 link: LinkModel | None = None, link_overrides: dict | None = None):
        if path not in PATHS:
            raise ValueError(f"sparse path {path!r} is not one of {PATHS}")
        self.group, self.world, self.path = group, world, path
        self.dense = BucketedAllReduce(group, world, bucket_bytes)
        self.link = link
        self.link_overrides = {k: v for k, v in (link_overrides or {}).items() if v}
        self.steps = 0
        self.last: list[PathChoice] = []
        """The choice for every row-sparse parameter in the last :meth:`sync`."""
        self._watched: dict[int, weakref.ref] = {}
        self.factors: dict[str, float] = {}
        """Per path: measured / predicted time, learned from earlier steps (same on all ranks)."""
        self._observed: dict[str, float] = {}
        self._device = None
        self._buffers: dict[int, tuple[torch.Tensor, weakref.ref | None]] = {}
        """Per parameter: the dense path's table buffer and the gradient made from it."""

    def watch(self, modules) -> None:
        """Register the embedding tables inside ``modules`` as row-sparse parameters."""
        for module in modules:
            for m in module.modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                    self._watched[id(m.weight)] = weakref.ref(m.weight)

    def is_row_sparse(self, p: torch.Tensor) -> bool:
        """Whether this rank sees ``p`` as row-sparse (sparse grad or watched embedding)."""
        ref = self._watched.get(id(p))
        return (p.grad is not None and p.grad.is_sparse) or (ref is not None and ref() is p)

    def step(self, slots: list) -> None:
        """Update, then re-learn the embedding tables (layers may have moved)."""
        super().step(slots)
        self._watched.clear()
        self.watch([s.module for s in slots])

    def _learn(self, slow: torch.Tensor) -> None:
        """Fold last step's measured/predicted ratios (every rank's, gathered) into factors."""
        for j, path in enumerate(_EXCHANGE_PATHS):
            seen = [int(x) for x in slow[:, j].tolist() if x > 0]
            if seen:  # the slowest rank decides when a collective finishes
                ratio = max(seen) / 1000
                self.factors[path] = 0.5 * self.factors.get(path, 1.0) + 0.5 * ratio

    def _free_buffer(self, p: torch.Tensor) -> torch.Tensor | None:
        """The dense path's buffer for ``p`` if no live gradient still uses it."""
        entry = self._buffers.pop(id(p), None)
        if entry is None:
            return None
        buf, grad_ref = entry
        return buf if grad_ref is None or grad_ref() is None else None

    def model(self) -> LinkModel:
        """The cost model, calibrated on first use (every rank of the group calls sync)."""
        if self.link is None:
            base = self.link_overrides
            keys = ("latency_s", "bandwidth", "allreduce_bandwidth", "merge_rate")
            if all(base.get(k) for k in keys):
                self.link = LinkModel(**{k: base[k] for k in keys})
            else:
                measured = calibrate(self.group, self._device)
                self.link = LinkModel(**{k: base.get(k) or getattr(measured, k) for k in keys})
            log.info("sparse sync cost model: %s", self.link)
        return self.link

    def sync(self, params: list) -> list[PathChoice]:
        """Average the gradients of ``params`` in place; returns the row-sparse choices."""
        self.steps += 1
        self.last = []
        if self.world == 1 or not params:
            return self.last
        self._device = params[0].device
        sparse_idx = [i for i, p in enumerate(params) if self.is_row_sparse(p)]
        local, triples = [-1] * len(params), {}
        for i in sparse_idx:
            triples[i] = LocalRows.of(params[i])
            local[i] = triples[i].count
        # one all-gather: every rank's row count (-1 = dense here) for every parameter, its
        # gradient kind, and how much slower than predicted each path ran last step
        kinds = [int(p.grad is not None and p.grad.is_sparse) for p in params]
        slow = [round(self._observed.get(k, 0.0) * 1000) for k in _EXCHANGE_PATHS]
        counts = gather_counts(local + kinds + slow, self.group, params[0].device)
        n = len(params)
        self._learn(counts[:, 2 * n:])
        dense_params, seen = [], {}
        link = self.model() if self.path == "auto" else None
        for i, p in enumerate(params):
            col = counts[:, i].tolist()
            if min(col) < 0:
                if max(col) >= 0:
                    log.warning("parameter %d is row-sparse on some ranks only; sent dense", i)
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
                dense_params.append(p)
                continue
            any_sparse = bool(counts[:, n + i].max())
            t = triples[i]
            row_bytes = math.prod(t.row_shape) * torch.empty(0, dtype=t.dtype).element_size()
            if link is not None:
                choice = link.choose(col, t.height, row_bytes, self.world, any_sparse,
                                     factors=self.factors)
            else:
                choice = PathChoice(self.path if sum(col) else "none", tuple(col), forced=True)
            self.last.append(choice)
            local_sparse = p.grad.is_sparse if p.grad is not None else any_sparse
            if choice.path == "dense" and not any_sparse:
                dense_params.append(p)  # dense gradients everywhere: the plain all-reduce
                continue
            started = time.perf_counter()
            if choice.path == "none":
                summed = t.triple()
            elif choice.path == "dense":
                summed = exchange(t, col, "dense", self.group, self._free_buffer(p))
            else:
                self._buffers.pop(id(p), None)  # sparse again: let the table buffer go
                summed = exchange(t, col, choice.path, self.group)
            summed.values.div_(self.world)
            _write_grad(p, summed, local_sparse)
            if choice.path in _EXCHANGE_PATHS and choice.estimates_s:
                took = (time.perf_counter() - started) / choice.estimates_s[choice.path]
                seen[choice.path] = max(seen.get(choice.path, 0.0), took * self.factors.get(
                    choice.path, 1.0))
            if choice.path == "dense":
                buf = summed.values._base if summed.values._base is not None else summed.values
                self._buffers[id(p)] = (buf, weakref.ref(p.grad) if local_sparse else None)
        self.dense.sync(dense_params)
        self._observed = seen
        if self.last:
            log.info("sparse sync step %d: %s", self.steps,
                     ", ".join(f"{c.path} {list(c.counts)}" for c in self.last))
        return self.last


def _write_grad(p: torch.Tensor, t: RowSparse, sparse: bool) -> None:
    if sparse:
        p.grad = t.to_coo()
        return
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    else:
        p.grad.zero_()
    p.grad.index_copy_(0, t.rows, t.values)


def sparse_sync_from_config(cfg, group, world: int) -> SparseGradSync:
    """The strategy configured by ``cfg.sync`` (``sparse_*`` keys) for a dp group."""
    s = cfg.sync
    return SparseGradSync(group, world, int(cfg.parallel.bucket_mb * 2**20), path=s.sparse_path,
                          link_overrides=dict(latency_s=s.sparse_latency_s,
                                              bandwidth=s.sparse_bandwidth,
                                              allreduce_bandwidth=s.sparse_allreduce_bandwidth,
                                              merge_rate=s.sparse_merge_rate))


# --------------------------------------------------------------------------- wrapper


class SparseDataParallel(nn.Module):
    """Data parallel like ``DistributedDataParallel``, with row-sparse embedding gradients.

    Wrap the model on every rank; the parameters are broadcast from the group's first rank.
    After each ``backward`` the gradients are averaged over the group: embedding tables
    (and any parameter with a sparse gradient) through :class:`SparseGradSync`, the rest
    through the dense bucketed all-reduce. Use :meth:`no_sync` to accumulate gradients
    locally, or ``auto_sync=False`` and call :meth:`sync_gradients` yourself.

    Args:
        module: the model.
        process_group: the data-parallel group (None: the default group).
        path: ``"auto"`` or a forced path (see :data:`PATHS`).
        link: a cost model (None: calibrated at the first sync).
        bucket_mb: dense bucket size in MiB.
        auto_sync: synchronise at the end of every backward.
    """

    def __init__(self, module: nn.Module, process_group=None, *, path: str = "auto",
                 link: LinkModel | None = None, bucket_mb: float = 25.0, auto_sync: bool = True):
        super().__init__()
        self.module = module
        self.process_group = process_group
        world = dist.get_world_size(process_group)
        self.grad_sync = SparseGradSync(process_group, world, int(bucket_mb * 2**20), path=path,
                                        link=link)
        self.grad_sync.watch([module])
        src = _global_rank(process_group, 0)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=src, group=process_group)
        self._auto, self._enabled, self._queued = auto_sync, True, False
        self._params = [p for p in module.parameters() if p.requires_grad]
        if auto_sync:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def _grad_ready(self, _p: torch.Tensor) -> None:
        if self._enabled and not self._queued:
            self._queued = True  # sync once, after the whole backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.sync_gradients()

    def sync_gradients(self) -> list[PathChoice]:
        """Average the gradients now; returns the path taken for each row-sparse parameter."""
        return self.grad_sync.sync(self._params)

    @property
    def last_paths(self) -> list[PathChoice]:
        """The choices of the last synchronisation."""
        return self.grad_sync.last

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the automatic synchronisation inside this block (gradient accumulation)."""
        before, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = before
