"""Cost model of the sparse exchange: which collective is cheapest for given counts.

:class:`LinkModel` predicts each path's time from four constants that :func:`calibrate`
measures once with a micro-benchmark (and averages over the group, so every rank takes the
same path); :class:`PathChoice` records the choice of one step.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll

__all__ = ["ID_BYTES", "CostHistory", "LinkModel", "PathChoice", "calibrate", "all_gather_into",
           "size_band", "sticky_path", "density_moved", "FACTOR_WINDOW", "MIN_SAMPLES", "MAD_TO_SE",
           "MOVE", "REMEASURE_STEPS", "REMEASURE_MAX_STEPS"]

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
    noise: dict = field(default_factory=dict)
    """Per candidate path: its measurement noise (see :meth:`CostHistory.noise`)."""
    credit_s: dict = field(default_factory=dict)
    """Per candidate path: seconds taken off its estimate for what it spares the others
    (``allgather``: the count all-gather); a measurement is compared with the estimate
    before it."""

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


FACTOR_WINDOW = 5
"""Measured / predicted ratios kept per (path, size band): their median is the learned
factor, the median's standard error the path's measurement noise."""

MIN_SAMPLES = 3
"""Fresh ratios a (path, band) needs before it counts as measured: the fewest whose
spread says anything about the noise."""

MAD_TO_SE = 1.4826 * math.sqrt(math.pi / 2)
"""Standard error of a median from the median absolute deviation of ``n`` samples:
``MAD_TO_SE * MAD / sqrt(n)`` (1.4826 turns a MAD into a standard deviation for normal
noise, sqrt(pi / 2) is the median's efficiency against the mean)."""

REMEASURE_STEPS = 100
"""Steps after which a path's measurements at a size band are old: a path not taken since
counts as unmeasured again (its old ratios forgotten), so ``auto`` tries it once more if
its estimate is close (``sync.sparse_explore``). Each time a band ages its wait doubles, up
to :data:`REMEASURE_MAX_STEPS`, so a path that stays slower costs ever fewer tries."""

REMEASURE_MAX_STEPS = 1600
"""The longest wait before a path's measurements age (see :data:`REMEASURE_STEPS`)."""

MOVE = 2.0
"""The density *moves* when a table's rows (summed over ranks) leave ``[ref / MOVE, ref *
MOVE]`` of where its sticky path was chosen: the paths are then measured afresh."""


class CostHistory:
    """Per (path, size band): the last :data:`FACTOR_WINDOW` measured / predicted ratios.

    The median is the path's learned correction (one slow step cannot lock a path out);
    the median's relative standard error (from the MAD) is its measurement noise, the
    margin of :func:`sticky_path`. ``fresh`` counts the ratios taken since the band was last marked
    stale (:meth:`stale`): a stale band keeps its factor but counts as unmeasured, so it is
    explored again. Pure bookkeeping, the same on every rank when fed the same ratios.
    """

    def __init__(self):
        self.ratios: dict[tuple[str, int], collections.deque] = {}
        self.fresh: dict[tuple[str, int], int] = {}
        self.step = 0
        """Steps counted by :meth:`tick`."""
        self.last: dict[tuple[str, int], int] = {}
        """Per (path, band): the step of its latest ratio."""
        self.wait: dict[tuple[str, int], int] = {}
        """Per (path, band): steps without a ratio after which it ages (see :meth:`tick`)."""

    def tick(self) -> None:
        """One step has passed (every rank calls it once per sync, so every rank ages the
        same bands): a measured band without a new ratio for its wait
        (:data:`REMEASURE_STEPS`, doubling each time up to :data:`REMEASURE_MAX_STEPS`)
        forgets its ratios and counts as unmeasured, so a path left on measurements taken
        while the machine was busier is tried again when its estimate is close."""
        self.step += 1
        for key, last in self.last.items():
            wait = self.wait.get(key, REMEASURE_STEPS)
            if self.measured(*key) and self.step - last >= wait:
                self.ratios.pop(key, None)
                self.fresh[key] = 0
                self.wait[key] = min(2 * wait, REMEASURE_MAX_STEPS)

    def add(self, key: tuple[str, int], ratio: float) -> None:
        """Record one measured / predicted ratio of ``key = (path, band)``."""
        self.ratios.setdefault(key, collections.deque(maxlen=FACTOR_WINDOW)).append(ratio)
        self.fresh[key] = self.fresh.get(key, 0) + 1
        self.last[key] = self.step

    def stale(self, keys) -> None:
        """Count ``keys`` as unmeasured until they have :data:`MIN_SAMPLES` new ratios."""
        for key in keys:
            self.fresh[key] = 0

    def factors(self) -> dict[tuple[str, int], float]:
        """Every learned factor: the median of its window."""
        return {k: statistics.median(v) for k, v in self.ratios.items()}

    def measured(self, path: str, band: int) -> bool:
        """Whether ``path`` has :data:`MIN_SAMPLES` fresh ratios at ``band``."""
        return self.fresh.get((path, band), 0) >= MIN_SAMPLES

    def noise(self, path: str, band: int) -> float:
        """Relative standard error of the median ratio of ``path`` at ``band`` (0 below 2).

        Taken from the median absolute deviation (:data:`MAD_TO_SE` ``* MAD / sqrt(n) /
        median``), not the range: on a machine that shares its cores one step in a few is
        several times slower than the rest (a rank waits for a core), and a range grows with
        every such step until no path can ever be left, while the median (the factor) does
        not move. The MAD ignores those steps as the median does.
        """
        r = self.ratios.get((path, band))
        if not r or len(r) < 2:
            return 0.0
        med = statistics.median(r)
        mad = statistics.median(abs(x - med) for x in r)
        return MAD_TO_SE * mad / (math.sqrt(len(r)) * med)

    def factor(self, path: str, band: int) -> float:
        """The band's own correction, else one learned at a neighbouring band of the same
        path (4x smaller or larger), else 1. Farther bands say nothing: a latency-bound
        small transfer's correction would mislead at hundreds of MB. Until the band has
        :data:`MIN_SAMPLES` fresh ratios its own correction counts only where it is the
        lower: a path's first transfer at a new size is cold (fresh buffers fault their
        pages in: 4.9 x its later ratio here), and one such sample must not keep it from
        ever being taken again."""
        near = [(abs(b - band), b) for p, b in self.ratios
                if p == path and b != band and abs(b - band) <= 1]
        other = statistics.median(self.ratios[path, min(near)[1]]) if near else 1.0
        if (path, band) not in self.ratios:
            return other
        own = statistics.median(self.ratios[path, band])
        return own if self.measured(path, band) else min(own, other)


def sticky_path(est: dict[str, float], noise: dict[str, float], current: str | None) -> str:
    """Keep ``current`` unless another path is cheaper beyond both paths' noise.

    ``est``: corrected estimate per path; ``noise``: each path's relative standard error of
    its learned factor (:meth:`CostHistory.noise`). The cheapest path ``b`` replaces
    ``current`` only when ``est[b] * (1 + noise[b]) < est[current] * (1 - noise[current])``:
    one standard error up, the other is still cheaper than the current path one standard
    error down. So a path within its noise of the best is never left for one that is only
    cheaper by noise.
    """
    best = min(est, key=est.get)
    if current is None or current not in est or current == best:
        return best
    if est[best] * (1 + noise.get(best, 0.0)) < est[current] * (1 - noise.get(current, 0.0)):
        return best
    return current


def density_moved(total: int, ref: int) -> bool:
    """Whether ``total`` rows left ``[ref / MOVE, ref * MOVE]`` (see :data:`MOVE`)."""
    return not ref / MOVE <= total <= ref * MOVE


@dataclass(frozen=True)
class LinkModel:
    """Predicts each path's time from a few measured constants (see :func:`calibrate`).

    All-gather is a ring (each rank sends ``(W-1)`` chunks); broadcast is one binomial
    tree per rank with rows, all posted at once: every rank receives the others' rows and,
    over the trees, sends as many bytes on average (``(W-1)/W`` of all rows), so the trees
    share the links rather than queue on one (taking ``ceil(log2 W)`` full copies of every
    row in turn over-estimated it 3x at 10 % density here, so it was never tried);
    all-reduce is a ring (``2(W-1)/W`` of the data per rank); merging gathered rows and
    filling a dense buffer cost ``bytes / merge_rate``.
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
        senders = [c for c in counts if c]
        bc_bytes = (w - 1) * total * sent_row / w
        out["broadcast"] = (len(senders) * a + bc_bytes / self.bandwidth + merge, bc_bytes)
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
               sparse_input: bool, force: str = "auto", history: CostHistory | None = None,
               explore: float = 0.0, current: str | None = None,
               allgather_credit_s: float = 0.0) -> PathChoice:
        """The path to take: forced, explored, the sticky ``current`` or the cheapest.

        Args:
            history: measured / predicted ratios of earlier steps; each estimate is
                multiplied by its path's factor at that band (or at the nearest band
                measured), so a path that keeps running slower than the model says loses.
            explore: when > 0 and the path it would take has been measured at its band, a
                path not measured at its band (see :meth:`CostHistory.measured`) whose estimate
                is within ``explore`` times the cheapest is taken instead, until it is, so
                that its factor and noise are learned too (otherwise a path the model
                over-estimates is never tried again).
            current: the path taken last time (None: none yet); kept unless another is
                cheaper beyond both paths' noise (:func:`sticky_path`).
            allgather_credit_s: what the ``allgather`` path saves besides its own time: held,
                it carries the counts, so the separate count all-gather every other path
                needs first is not made (its measured time; at most 90 % of the path's
                estimate is taken off).
        """
        counts = [int(c) for c in counts]
        if sum(counts) == 0:
            return PathChoice("none", tuple(counts))
        history = history or CostHistory()
        raw = self.estimates(counts, height, row_bytes, world, sparse_input)
        band = {k: size_band(v[1]) for k, v in raw.items()}
        fac = {k: history.factor(k, band[k]) for k in raw}
        est = {k: v[0] * fac[k] for k, v in raw.items()}
        credit = {}
        if allgather_credit_s > 0:
            credit["allgather"] = min(allgather_credit_s, 0.9 * est["allgather"])
            est["allgather"] -= credit["allgather"]
        noise = {k: history.noise(k, band[k]) for k in raw}
        explored = False
        if force != "auto":
            path = force
        else:
            path = sticky_path(est, noise, current)
            unmeasured = [k for k in est if k != path and not history.measured(k, band[k])
                          and est[k] <= explore * est[path]]
            if explore > 0 and history.measured(path, band[path]) and unmeasured:
                path, explored = min(unmeasured, key=est.get), True
        return PathChoice(path, tuple(counts), est, raw[path][1], forced=force != "auto",
                          explored=explored, factors=fac, noise=noise, credit_s=credit)


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
