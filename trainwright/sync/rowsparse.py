"""The row-sparse triple *rows + height + values* and one rank's rows of a gradient.

:class:`RowSparse` is PaddlePaddle's SelectedRows: sorted unique row ids, the table's
height, one value row per id. :class:`LocalRows` is what a rank has before the exchange,
summing duplicate ids only when the path needs it. ``_pack`` / ``_unpack`` lay one rank's
rows out as one flat block (value rows, then ids as value elements) and ``_merge`` sums
the received blocks; :mod:`trainwright.sync.sparse` moves the blocks between ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainwright.sync.sparse_cost import ID_BYTES

__all__ = ["RowSparse", "LocalRows", "touched_rows", "union_slots"]


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
        rows = touched_rows(grad)
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


def _rows_and_inverse(ids: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique rows and each id's position among them, from a ``_unique_rows`` plan."""
    if isinstance(plan, tuple):
        return plan
    return plan.nonzero().squeeze(1), union_slots(plan).index_select(0, ids)


def union_slots(mark: torch.Tensor) -> torch.Tensor:
    """For a table-sized mark of touched rows: each marked row's position among the marked
    rows (a running count; an ``index_put_`` of ``arange`` is ~7x slower on CPU). Entries
    of unmarked rows are meaningless."""
    return mark.cumsum(0, dtype=torch.int64).sub_(1)


def _sum_duplicates(ids: torch.Tensor, values: torch.Tensor, height: int,
                    plan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ids and the summed value row of each."""
    if ids.numel() == 0:
        return ids, values
    if plan is None:
        _, plan = _unique_rows(ids, height)
    rows, inverse = _rows_and_inverse(ids, plan)
    if rows.numel() == ids.numel():  # no duplicates: a permutation
        out = torch.empty_like(values)
        out[inverse] = values
        return rows, out
    out = values.new_zeros((rows.numel(), *values.shape[1:]))
    out.index_add_(0, inverse, values)
    return rows, out


def touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """Sorted ids of the rows of a dense gradient with any non-zero entry.

    Tests the rows' bytes, not their values: ~8x faster than ``grad.ne(0).any(1)`` on CPU
    (no full-size temporary), NaN counts as touched, and a row holding only ``-0.0`` is
    sent too (adding it changes nothing).
    """
    flat = grad.reshape(grad.shape[0], math.prod(grad.shape[1:]))
    if flat.is_contiguous() and flat.numel():
        mask = flat.view(torch.uint8).any(dim=1)
    else:
        mask = flat.ne(0).any(dim=1)
    return mask.nonzero().squeeze(1)


class LocalRows:
    """One rank's rows of one gradient: counted at once, duplicates summed only if needed.

    The dense path never needs the summed triple: raw ids and values are scattered
    straight into the all-reduce buffer (``index_add_`` sums duplicates on the way). For a
    dense gradient only the touched rows are found at once; their values are copied out
    only if a path needs them (the plain all-reduce of dense gradients does not).
    """

    def __init__(self, triple: RowSparse | None = None, ids: torch.Tensor | None = None,
                 values: torch.Tensor | None = None, height: int = 0,
                 dense: torch.Tensor | None = None):
        self._triple, self._ids, self._values, self._plan = triple, ids, values, None
        self._dense = self._rows = None
        if dense is not None:
            self._dense, self._rows = dense, touched_rows(dense)
            self.height, self.row_shape = dense.shape[0], tuple(dense.shape[1:])
            self.count, self.dtype, self.device = self._rows.numel(), dense.dtype, dense.device
        elif triple is not None:
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
            return cls(dense=g)
        if g.is_coalesced() or g.sparse_dim() != 1:
            return cls(RowSparse.from_coo(g))
        return cls(ids=g._indices()[0], values=g._values(), height=g.shape[0])

    def triple(self) -> RowSparse:
        """The triple with duplicates summed."""
        if self._triple is None and self._dense is not None:
            vals = self._dense.index_select(0, self._rows)
            self._triple = RowSparse(self._rows, self.height, vals)
            self._dense = self._rows = None
        elif self._triple is None:
            rows, vals = _sum_duplicates(self._ids, self._values, self.height, self._plan)
            self._triple = RowSparse(rows, self.height, vals)
            self._ids = self._values = self._plan = None
        return self._triple

    def mark(self, mark: torch.Tensor) -> None:
        """Set ``mark[row] = 1`` for every row this rank touched."""
        rows = self._ids if self._ids is not None else self._rows
        mark.index_fill_(0, self._triple.rows if rows is None else rows, 1)

    def scatter_into(self, block: torch.Tensor, slot: torch.Tensor | None) -> None:
        """Add the rows into ``block`` (``(n, width)``) at ``slot[row]`` (None: at ``row``).

        Raw (repeated) ids go through ``scatter_add_`` with the id broadcast along the row:
        on CPU it is ~2x faster than ``index_add_``, which runs one small add per id.
        """
        width = block.shape[1]
        if self._ids is None:  # unique rows: a copy, no sum
            t = self.triple()
            at = t.rows if slot is None else slot.index_select(0, t.rows)
            block.index_copy_(0, at, t.values.reshape(t.count, width))
        else:
            at = self._ids if slot is None else slot.index_select(0, self._ids)
            block.scatter_add_(0, at.unsqueeze(1).expand(-1, width),
                               self._values.reshape(self._ids.numel(), width))


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
    rows, inverse = _rows_and_inverse(ids, plan)
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
