"""Sparse gradient synchronisation as *rows + height + values*.

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
   ``dense`` (when that is cheaper, e.g. at high density: the ids' values are added
   straight into the block that is all-reduced in place and becomes the gradient, so it
   costs what a plain dense all-reduce of the table costs);
3. the gathered rows are summed into the target sparse gradient and divided by the group
   size, exactly like dense DDP averages.

Each rank's rows travel as one flat block, value rows then ids (each int64 id's bytes
reinterpreted as 1, 2 or 4 value elements), so each transfer is one collective and the
received values stay contiguous for the merge. Per-path, per-size correction factors,
learned from measured / predicted times and agreed through the count all-gather, keep the
model honest at sizes the start-up calibration did not see; a path not yet measured at the
current size is tried when its estimate is close, and ``auto`` holds a path until another is
cheaper beyond both paths' measured noise, measuring afresh when the density moves (see
:func:`~trainwright.sync.sparse_cost.sticky_path`) and, for a path not taken, once its
measurements are old (:data:`~trainwright.sync.sparse_cost.REMEASURE_STEPS`). The triple
itself lives in :mod:`trainwright.sync.rowsparse`.

:class:`SparseGradSync` is the :class:`~trainwright.sync.GradSync` strategy (pipeline dp
groups, ``sync.sparse = true``);
:class:`~trainwright.sync.sparse_ddp.SparseDataParallel` wraps it like DDP for plain data
parallel. Both send every other parameter through
:class:`~trainwright.sync.dense.BucketedAllReduce`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import time
import weakref

import torch
from torch import nn

from trainwright.sync.base import GradSync
from trainwright.sync.dense import BucketedAllReduce
from trainwright.sync.rowsparse import LocalRows, RowSparse
from trainwright.sync.sparse_cost import (
    CostHistory,
    LinkModel,
    PathChoice,
    calibrate,
    density_moved,
    size_band,
)
from trainwright.sync.sparse_exchange import (
    EXCHANGE_PATHS,
    carried_sum,
    exchange,
    gather_counts,
    gather_counts_with_rows,
)

__all__ = ["RowSparse", "LocalRows", "LinkModel", "PathChoice", "PATHS", "calibrate",
           "SparseGradSync", "sparse_sync_from_config"]

log = logging.getLogger(__name__)

PATHS = ("auto", *EXCHANGE_PATHS)
"""Values of ``sync.sparse_path``: ``auto`` lets the cost model choose, the others force."""

CAPACITY_HEADROOM = 0.1
"""Rows sent with the counts, until a table's largest count has been seen to change over
:data:`GROWTH_WINDOW` steps: last step's largest count plus this share (at least 16 rows);
a rank with more makes that parameter's exchange run again, after the counts."""

GROWTH_WINDOW = 8
"""Steps over which a table's largest count is watched: once seen that often, the rows
sent with the counts are last step's largest count plus its largest step-to-step growth
in that window, at most :data:`CAPACITY_HEADROOM` (at least 16 rows). Every padded row is
sent by every rank: 10 % of padding at 1 % density was 1.6 ms of a 19 ms sync over a
1 Gbit/s link, with counts that do not move."""

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
        explore: try a path not yet measured at this transfer size when its estimate is
            within this factor of the cheapest (0 = never); see :meth:`LinkModel.choose`.
    """

    def __init__(self, group, world: int, bucket_bytes: int = 25 * 2**20, *, path: str = "auto",
                 link: LinkModel | None = None, link_overrides: dict | None = None,
                 explore: float = 2.0):
        if path not in PATHS:
            raise ValueError(f"sparse path {path!r} is not one of {PATHS}")
        if explore < 0:
            raise ValueError(f"explore must be >= 0, got {explore}")
        self.group, self.world, self.path, self.explore = group, world, path, explore
        self.dense = BucketedAllReduce(group, world, bucket_bytes)
        self.link = link
        self.link_overrides = {k: v for k, v in (link_overrides or {}).items() if v}
        self.steps = 0
        self.last: list[PathChoice] = []
        """The choice for every row-sparse parameter in the last :meth:`sync`."""
        self._watched: dict[int, weakref.ref] = {}
        self.history = CostHistory()
        """Per (path, size band): measured / predicted times of earlier steps (the same on
        every rank): the learned factors and each path's noise."""
        self._chosen: dict[int, PathChoice] = {}
        """Per row-sparse parameter: ``auto``'s last choice (see :meth:`_ahead`)."""
        self._sticky: dict[int, tuple[str, int]] = {}
        """Per row-sparse parameter: the path ``auto`` holds and the rows (summed over
        ranks) it was chosen at; see :func:`~trainwright.sync.sparse_cost.sticky_path`."""
        self._observed: dict[tuple[str, int], float] = {}
        self._device = None
        self._buffers: dict[int, tuple[torch.Tensor, weakref.ref | None]] = {}
        """Per parameter: the dense path's table buffer and the gradient made from it."""
        self._counts_s: collections.deque = collections.deque(maxlen=5)
        self._counts_took = 0.0
        self._carried: tuple | None = None
        """Last step's carried rows: ``((path, band), model seconds, this rank's collective
        seconds, this rank's seconds after it)``, learned once gathered (see :meth:`sync`)."""
        self._growth: dict[int, collections.deque] = {}
        """Per row-sparse parameter: the relative growth of its largest count, step to step,
        over the last :data:`GROWTH_WINDOW` steps (gathered, so the same on every rank)."""
        self._seen: dict[int, tuple] = {}
        """Per row-sparse parameter, from last step's gathered counts (the same on every
        rank): ``(counts, any_sparse, row_bytes, height, row_shape, dtype)``."""

    def watch(self, modules) -> None:
        """Register the embedding tables inside ``modules`` as row-sparse parameters."""
        for module in modules:
            for m in module.modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                    self._watched[id(m.weight)] = weakref.ref(m.weight)

    def attach(self, modules: list) -> None:
        """The stage's layers (all of them, after every change): their embedding tables are
        row-sparse (see :meth:`watch`); tables of layers that left are forgotten."""
        self._watched.clear()
        self.watch(modules)

    @property
    def counts_s(self) -> float:
        """The separate count all-gather's own time (the rank that arrived last, which
        waited least; the median of the last 5 measurements, 0 before one): what the
        ``allgather`` path saves when the counts ride with it."""
        return statistics.median(self._counts_s) if self._counts_s else 0.0

    def is_row_sparse(self, p: torch.Tensor) -> bool:
        """Whether this rank sees ``p`` as row-sparse (sparse grad or watched embedding)."""
        ref = self._watched.get(id(p))
        return (p.grad is not None and p.grad.is_sparse) or (ref is not None and ref() is p)

    @property
    def factors(self) -> dict[tuple[str, int], float]:
        """Per (path, size band): the learned measured / predicted time."""
        return self.history.factors()

    def _learn(self, keys: list[tuple[str, int]], slow: torch.Tensor) -> None:
        """Fold last step's measured / predicted ratios into :attr:`history`.

        ``slow[r, j]`` is rank r's ratio x 1000 for ``keys[j]`` (the (path, band) pairs last
        step took, the same list on every rank since every rank took the same choices).
        The slowest rank counts, since it decides when a collective ends. A band's factor is
        the median of its last :data:`~trainwright.sync.sparse_cost.FACTOR_WINDOW` ratios:
        one step slowed by something else on the machine cannot lock a path out, as a
        running mean let it (a path's factor only changes when it is taken again).
        """
        for j, key in enumerate(keys):
            ratio = int(slow[:, j].max()) / 1000
            if ratio > 0:
                self.history.add(key, ratio)

    def _choose(self, p: torch.Tensor, link: LinkModel, col: list[int], height: int,
                row_bytes: int, any_sparse: bool) -> PathChoice:
        """``auto``'s sticky choice for ``p``; the paths are measured afresh when the
        density moved (:func:`~trainwright.sync.sparse_cost.density_moved`)."""
        total, held = sum(col), self._sticky.get(id(p))
        if held is not None and density_moved(total, held[1]):
            est = link.estimates(col, height, row_bytes, self.world, any_sparse)
            self.history.stale((k, size_band(b)) for k, (_, b) in est.items())
            log.info("sparse sync: rows moved from %d to %d; measuring the paths again",
                     held[1], total)
            held = None
        choice = link.choose(col, height, row_bytes, self.world, any_sparse,
                             history=self.history, explore=self.explore,
                             current=held[0] if held else None,
                             allgather_credit_s=self.counts_s)
        if not choice.explored and choice.path != "none":
            kept = held is not None and held[0] == choice.path
            self._sticky[id(p)] = (choice.path, held[1] if kept else total)
        self._chosen[id(p)] = choice
        return choice

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
        self.history.tick()  # measurements of paths not taken for a while age (CostHistory)
        sparse_idx = [i for i, p in enumerate(params) if self.is_row_sparse(p)]
        local, triples = [-1] * len(params), {}
        for i in sparse_idx:
            triples[i] = LocalRows.of(params[i])
            local[i] = triples[i].count
        # one all-gather: every rank's row count (-1 = dense here) for every parameter, its
        # gradient kind, and how much slower than predicted each path ran last step
        kinds = [int(p.grad is not None and p.grad.is_sparse) for p in params]
        keys = sorted(self._observed)
        slow = [round(self._observed[k] * 1000) for k in keys]
        # with them, how long this rank's last separate count all-gather took (us; 0: none)
        # and how long the carried rows' collective and the work after it took (us; 0: none)
        carried_us = [round(t * 1e6) for t in self._carried[2:]] if self._carried else [0, 0]
        meta = local + kinds + slow + [round(self._counts_took * 1e6), *carried_us]
        ahead, carried = self._ahead(params), None
        fused_started = time.perf_counter()
        if ahead is None:
            counts = gather_counts(meta, self.group, params[0].device)
            self._counts_took = time.perf_counter() - fused_started
        else:  # one parameter's rows travel with the counts
            i, cap, shape, dtype = ahead
            mine = triples.get(i)
            fits = mine is not None and (mine.row_shape, mine.dtype) == (shape, dtype)
            counts, carried = gather_counts_with_rows(
                meta, mine.triple() if fits else None, cap, row_shape=shape, dtype=dtype,
                group=self.group, device=params[0].device)
            self._counts_took = 0.0
        gathered = time.perf_counter()
        n = len(params)
        self._learn(keys, counts[:, 2 * n: 2 * n + len(keys)])
        # the last rank to arrive waited least: its times are the collectives' own
        took = counts[:, -3][counts[:, -3] > 0]
        if took.numel():
            self._counts_s.append(int(took.min()) / 1e6)
        if self._carried is not None and int(counts[:, -2].min()) > 0:
            self.history.add(self._carried[0], self._carried_ratio(counts[:, -2:]))
        self._carried = None
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
            if id(p) in self._seen:  # how much the largest count grew since last step
                before = max(self._seen[id(p)][0])
                self._growth.setdefault(id(p), collections.deque(maxlen=GROWTH_WINDOW)).append(
                    max(0.0, max(col) / before - 1) if before else 1.0)
            self._seen[id(p)] = (tuple(col), any_sparse, row_bytes, t.height, t.row_shape,
                                 t.dtype)
            if link is not None:
                choice = self._choose(p, link, col, t.height, row_bytes, any_sparse)
            else:
                choice = PathChoice(self.path if sum(col) else "none", tuple(col), forced=True)
            self.last.append(choice)
            local_sparse = p.grad.is_sparse if p.grad is not None else any_sparse
            started = time.perf_counter()
            if choice.path == "dense" and not any_sparse:
                # dense gradients everywhere: the plain all-reduce, in place, on its own
                self.dense.sync([p])
                self._observe(choice, started, seen)
                continue
            if choice.path == "none":
                summed = t.triple()
            elif ahead is not None and ahead[0] == i and choice.path == "allgather" \
                    and max(col) <= ahead[1] and ahead[2:] == (t.row_shape, t.dtype):
                # the rows came with the counts: timed from the collective's start, which
                # also waited for the last rank to arrive (learned at the next gather)
                started = None
                summed = carried_sum(carried, ahead[1], col, t.height, t.row_shape)
            elif choice.path == "dense":
                summed = exchange(t, col, "dense", self.group, self._free_buffer(p))
            else:
                self._buffers.pop(id(p), None)  # sparse again: let the table buffer go
                summed = exchange(t, col, choice.path, self.group)
            summed.values.div_(self.world)
            _write_grad(p, summed, local_sparse)
            if started is not None:
                self._observe(choice, started, seen)
            elif choice.estimates_s:
                raw = _model_s(choice, "allgather") / choice.factors["allgather"]
                self._carried = (("allgather", choice.band), raw, gathered - fused_started,
                                 time.perf_counter() - gathered)
            if choice.path == "dense":
                buf = summed.values._base if summed.values._base is not None else summed.values
                self._buffers[id(p)] = (buf, weakref.ref(p.grad) if local_sparse else None)
                # the estimate assumed the largest possible union; report what was sent
                sent = 2 * (self.world - 1) / self.world * (t.height + summed.count * row_bytes)
                self.last[-1] = dataclasses.replace(choice, bytes_sent_per_rank=sent)
        self.dense.sync(dense_params)
        self._observed = seen
        if self.last:
            log.info("sparse sync step %d: %s", self.steps,
                     ", ".join(f"{c.path}{' (measuring it)' if c.explored else ''} "
                               f"{list(c.counts)}" for c in self.last))
        return self.last


    def _ahead(self, params: list) -> tuple | None:
        """The parameter whose rows travel with this step's counts, how many rows and their
        layout: ``(index, capacity, row_shape, dtype)``, or None. Decided from gathered
        state only, so every rank decides the same: the first parameter that was row-sparse
        last step, when its path is ``allgather`` whatever this step's counts turn out to
        be (forced, or ``auto``'s held path, kept at last step's counts: neither left nor
        set aside to measure another). Should the counts say otherwise after all, that
        parameter is exchanged again along the chosen path.

        ``auto``'s last choice for the parameter says it: asked again at last step's counts,
        the cost model would answer the same, since what it learns (the ratios gathered with
        the counts) only arrives with this step's gather."""
        i = next((i for i, p in enumerate(params) if id(p) in self._seen), None)
        if i is None or self.path not in ("auto", "allgather"):
            return None
        col, _, _, _, shape, dtype = self._seen[id(params[i])]
        if self.path == "auto":
            last = self._chosen.get(id(params[i]))
            if last is None or last.path != "allgather" or last.explored:
                return None
        top, growth = max(col), self._growth.get(id(params[i]), ())
        # never above the 10 %: a density that jumps (x10) is one step's re-exchange, while
        # a 10x padding for the next 8 steps made the carried all-gather look 3x slower
        # than it is and auto left it for broadcast at 1 % for good
        share = min(CAPACITY_HEADROOM, max(growth)) if len(growth) == GROWTH_WINDOW \
            else CAPACITY_HEADROOM
        return i, top + max(16, math.ceil(share * top)), shape, dtype

    def _carried_ratio(self, times_us: torch.Tensor) -> float:
        """Measured / predicted time of last step's carried rows, from every rank's
        ``[collective, after]`` microseconds: the collective's own time is the shortest (the
        rank that arrived last waited least), the work after it (merge, divide, write) the
        slowest rank's, as for every other path: ranks that share cores merge one after
        another, and the sync ends when the last is done."""
        measured = (int(times_us[:, 0].min()) + int(times_us[:, 1].max())) / 1e6
        return measured / self._carried[1]

    @staticmethod
    def _observe(choice: PathChoice, started: float, seen: dict) -> None:
        """Note measured / predicted time of ``choice`` (gathered and learned next step)."""
        if choice.path in EXCHANGE_PATHS and choice.estimates_s:
            # measured / the model's own (uncorrected) estimate
            took = (time.perf_counter() - started) / _model_s(choice, choice.path)
            key = (choice.path, choice.band)
            seen[key] = max(seen.get(key, 0.0), took * choice.factors[choice.path])


def _model_s(choice: PathChoice, path: str) -> float:
    """``path``'s corrected estimate before any credit (what its time is compared with)."""
    return choice.estimates_s[path] + choice.credit_s.get(path, 0.0)


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
                                              merge_rate=s.sparse_merge_rate),
                          explore=s.sparse_explore)
