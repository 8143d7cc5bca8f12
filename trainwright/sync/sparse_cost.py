"""Cost model of the sparse exchange: which collective is cheapest for given counts.

:class:`LinkModel` predicts each path's time from four constants that :func:`calibrate`
measures once with a micro-benchmark (and averages over the group, so every rank takes the
same path); :class:`PathChoice` records the choice of one step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll

__all__ = ["ID_BYTES", "LinkModel", "PathChoice", "calibrate", "all_gather_into",
           "size_band"]

ID_BYTES = 8
"""Row ids travel as int64."""

all_gather_into = coll.all_gather_into_tensor
"""The all-gather into one flat tensor (its name in this torch version)."""



@dataclass(frozen=True)
class PathChoice:
    """The path taken for one parameter in one step, with the model's estimates."""

    path: str
    """``"allgather"``, ``"broadcast"``, ``"dense"`` or ``"none"`` (no rank has rows)."""
    counts: tuple[int, ...]
    """Valid rows per rank."""
    estimates_s: dict = field(default_factory=dict)
    """Predicted seconds per candidate path."""
    bytes_sent_per_rank: float = 0.0
    """Bytes the chosen collective makes an average rank send (by its algorithm); for the
    dense path of sparse gradients, with the union of touched rows found in the exchange."""
    forced: bool = False
    """True when ``sync.sparse_path`` named the path instead of ``auto``."""
    explored: bool = False
    """True when the path was taken to measure it (see :meth:`LinkModel.choose`), not
    because it had the lowest estimate."""
    factors: dict = field(default_factory=dict)
    """Per candidate path: the learned correction its estimate was multiplied by."""

    @property
    def band(self) -> int:
        """Size class of the chosen transfer (see :func:`size_band`)."""
        return size_band(self.bytes_sent_per_rank)


def size_band(nbytes: float) -> int:
    """Factor-4 size class of a transfer; a learned correction applies within one class.

    Per-byte costs on CPU change with the size (caches, page faults, gloo's chunking), so
    a correction measured at 8 MB says little about 100 MB.
    """
    return int(math.log2(max(float(nbytes), 1.0)) // 2)


def _factor(factors: dict, path: str, band: int) -> tuple[float, bool]:
    """``(factor, measured)`` for ``path`` at ``band``: the band's own learned correction,
    else one learned at a neighbouring band of the same path (4x smaller or larger),
    else 1. Farther bands say nothing: a latency-bound small transfer's correction would
    mislead at hundreds of MB."""
    if (path, band) in factors:
        return factors[path, band], True
    near = [(abs(b - band), b) for p, b in factors if p == path and abs(b - band) <= 1]
    return (factors[path, min(near)[1]], False) if near else (1.0, False)


@dataclass(frozen=True)
class LinkModel:
    """Predicts each path's time from a few measured constants (see :func:`calibrate`).

    All-gather is a ring (each rank sends ``(W-1)`` chunks), broadcast a binomial tree
    (``ceil(log2 W)`` rounds, gloo's algorithm), all-reduce a ring (``2(W-1)/W`` of the data
    per rank); merging gathered rows and filling a dense buffer cost ``bytes / merge_rate``.
    """

    latency_s: float
    """Fixed cost of one collective call."""
    bandwidth: float
    """Bytes/s one rank moves in an all-gather or broadcast."""
    allreduce_bandwidth: float
    """Bytes/s of ring all-reduce traffic per rank (includes the reduction)."""
    merge_rate: float
    """Bytes/s of local scatter-add (summing gathered rows, filling a dense buffer)."""

    def estimates(self, counts: list[int], height: int, row_bytes: int, world: int,
                  sparse_input: bool) -> dict[str, tuple[float, float]]:
        """``path -> (seconds, bytes sent per rank)`` for every path that applies.

        Args:
            counts: valid rows of each rank.
            height: rows of the full table.
            row_bytes: bytes of one value row.
            world: ranks in the group.
            sparse_input: the gradient is sparse, so the dense path first all-reduces a
                one-byte touched-row mark, then fills and all-reduces the union's rows.
        """
        a, w = self.latency_s, world
        total, top = sum(counts), max(counts)
        sent_row = row_bytes + ID_BYTES
        merge = total * row_bytes / self.merge_rate
        ag_bytes = (w - 1) * top * sent_row
        out = {"allgather": (a + ag_bytes / self.bandwidth + merge, ag_bytes)}
        rounds = math.ceil(math.log2(w)) if w > 1 else 0
        senders = [c for c in counts if c]
        out["broadcast"] = (len(senders) * a + rounds * total * sent_row / self.bandwidth + merge,
                            (w - 1) * total * sent_row / w)
        if sparse_input:
            # a one-byte touched-row mark first, then only the union of touched rows (at
            # most min(height, total) of them) is filled and all-reduced
            union = min(height, total)
            ar_bytes = 2 * (w - 1) / w * (height + union * row_bytes)
            cost = 2 * a + ar_bytes / self.allreduce_bandwidth + union * row_bytes / self.merge_rate
        else:
            ar_bytes = 2 * (w - 1) / w * height * row_bytes
            cost = a + ar_bytes / self.allreduce_bandwidth
        out["dense"] = (cost, ar_bytes)
        return out

    def choose(self, counts: list[int], height: int, row_bytes: int, world: int,
               sparse_input: bool, force: str = "auto", factors: dict | None = None,
               explore: float = 0.0) -> PathChoice:
        """The cheapest path by :meth:`estimates` (or the forced one).

        Args:
            factors: ``(path, size band) -> measured / predicted time`` of earlier steps;
                each estimate is multiplied by its path's factor at that band (or at the
                nearest band measured), so a path that keeps running slower than the
                model says loses.
            explore: when > 0 and the cheapest path has been measured at its band, a path
                never measured at its band whose estimate is within ``explore`` times the
                cheapest is taken instead, once, so that its factor is learned too
                (otherwise a path the model over-estimates is never tried again).
        """
        counts = [int(c) for c in counts]
        if sum(counts) == 0:
            return PathChoice("none", tuple(counts))
        raw = self.estimates(counts, height, row_bytes, world, sparse_input)
        fac = {k: _factor(factors or {}, k, size_band(v[1])) for k, v in raw.items()}
        est = {k: v[0] * fac[k][0] for k, v in raw.items()}
        explored = False
        if force != "auto":
            path = force
        else:
            path = min(est, key=est.get)
            unmeasured = [k for k in est if not fac[k][1] and est[k] <= explore * est[path]]
            if explore > 0 and fac[path][1] and unmeasured:
                path, explored = min(unmeasured, key=est.get), True
        return PathChoice(path, tuple(counts), est, raw[path][1], forced=force != "auto",
                          explored=explored, factors={k: v[0] for k, v in fac.items()})


def _median_time(fn, repeats: int) -> float:
    """Median of ``repeats`` runs after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate(group=None, device=None, *, chunk_bytes: int = 4 << 20,
              repeats: int = 3) -> LinkModel:
    """Measure the :class:`LinkModel` constants with a micro-benchmark (~0.5 s on CPU).

    Latency is the time of a one-element collective; bandwidths are slopes between a
    one-element and a ``chunk_bytes`` (all-gather) or ``4 * chunk_bytes`` (all-reduce)
    transfer; the merge rate times a local ``index_add_`` of ``chunk_bytes`` of rows.
    Sizes are megabytes, not kilobytes, because per-byte costs on CPU grow once buffers
    leave the caches. Every rank of ``group`` must call it; the results are averaged over
    the group so every rank holds the same model and takes the same path.
    """
    world = dist.get_world_size(group)
    dev = torch.device(device or "cpu")
    n = chunk_bytes // 4

    def timed(op):
        def run():
            op()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return _median_time(run, repeats)

    def gather(k):
        send, recv = torch.ones(k, device=dev), torch.empty(k * world, device=dev)
        return timed(lambda: all_gather_into(recv, send, group=group))

    def reduce(k):
        buf = torch.ones(k, device=dev)
        return timed(lambda: coll.all_reduce(buf, group=group))

    t_ag0, t_ag = gather(1), gather(n)
    t_ar0, t_ar = reduce(1), reduce(4 * n)
    rows = max(chunk_bytes // 256, 1)
    ids = torch.randint(0, rows, (rows,), device=dev)
    vals = torch.ones(rows, 64, device=dev)
    acc = torch.zeros(rows, 64, device=dev)
    t_merge = timed(lambda: acc.index_add_(0, ids, vals))
    eps = 1e-6
    measured = torch.tensor([
        (t_ag0 + t_ar0) / 2,
        (world - 1) * chunk_bytes / max(t_ag - t_ag0, eps),
        2 * (world - 1) / world * 4 * chunk_bytes / max(t_ar - t_ar0, eps),
        vals.numel() * 4 / max(t_merge, eps),
    ], dtype=torch.float64, device=dev)
    coll.all_reduce(measured, group=group)
    return LinkModel(*(measured / world).tolist())
