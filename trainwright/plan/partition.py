"""Split a pipeline model's clusters, in order, into contiguous stages.

A *cluster* is a run of consecutive layers that must stay on one stage (a residual block's
fork..join, or a straight run between such blocks). A partition of ``n`` clusters into ``k``
stages is fixed by its ``k - 1`` cuts. Cost model, per micro-batch:

* a stage's time is ``math.fsum`` of its clusters' ``time_s`` (forward + backward);
* a cut right after cluster ``c`` sends ``clusters[c].out_bytes``; a partition's communication
  is ``comm_bytes / link_bandwidth`` seconds, ``comm_bytes`` summed over its cuts;
* stage times are *balanced* (:func:`within_threshold`) when ``max - min <= threshold_s`` and
  ``min >= (1 - threshold_rel) * max``: that is ``(max - min) / max <= threshold_rel`` without
  the division, so the test is monotone in floating point (widening a window never turns an
  unbalanced partition balanced); a threshold left as None is not checked.

Two rules: :func:`minmax_partition` (least largest stage time) and :func:`seed_partition` (the
threshold rule: least communication among balanced partitions, else min-max). Pure: no torch.
Shared arguments: ``clusters`` (:class:`ClusterCost` rows in model order), ``k`` (stages,
``1 <= k <= len(clusters)``), ``link_bandwidth`` (bytes/s between neighbouring stages).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainwright.errors import PlanError

__all__ = [
    "ClusterCost", "Partition", "minmax_partition", "seed_partition", "imbalance",
    "within_threshold",
]

_NONE = 1 << 62  # "no partition" in the batched integer DP; byte totals must stay below it
_BATCH = 64  # windows per batched DP (memory: _BATCH * (n + 1) ** 2 int64)


@dataclass(frozen=True)
class ClusterCost:
    """One cluster: its layers, forward+backward seconds, bytes of a cut right after it."""

    layers: tuple[int, ...]
    time_s: float
    out_bytes: int


@dataclass
class Partition:
    """Clusters split into contiguous stages.

    Attributes:
        stages: layer indices of each stage, in model order.
        stage_times: seconds per micro-batch of each stage (``math.fsum`` of its clusters).
        comm_s: ``comm_bytes / link_bandwidth``: seconds per micro-batch on the ``k - 1`` cuts.
        max_time: the largest stage time.
        rule: ``"threshold"`` (the threshold rule found a balanced partition) or ``"minmax"``.
        sizes: clusters per stage.
        comm_bytes: bytes crossing the ``k - 1`` cuts.
    """

    stages: list[list[int]]
    stage_times: list[float]
    comm_s: float
    max_time: float
    rule: str
    sizes: list[int]
    comm_bytes: int

    def cuts(self) -> list[int]:
        """Cut positions, in clusters: a cut at ``c`` lies between clusters ``c - 1`` and ``c``.

        Returns:
            The index of the first cluster of stages ``1 .. k-1`` (``k - 1`` increasing ints).
        """
        return list(itertools.accumulate(self.sizes[:-1]))


def imbalance(stage_times: Sequence[float]) -> float:
    """Relative spread of stage times.

    Args:
        stage_times: seconds per stage.

    Returns:
        ``(max - min) / max``; 0 when empty or when ``max <= 0``.
    """
    if not stage_times or max(stage_times) <= 0:
        return 0.0
    return (max(stage_times) - min(stage_times)) / max(stage_times)


def _check_thresholds(threshold_s: float | None, threshold_rel: float | None) -> None:
    if threshold_s is None and threshold_rel is None:
        raise ValueError("give threshold_s (seconds) and/or threshold_rel (fraction of the "
                         "largest stage time); both are None")
    for name, t in (("threshold_s", threshold_s), ("threshold_rel", threshold_rel)):
        if t is not None and not t >= 0:
            raise ValueError(f"{name} must be >= 0 or None, got {t}")


def _balanced(lo: float, hi: float, threshold_s: float | None,
              threshold_rel: float | None) -> bool:
    return ((threshold_s is None or hi - lo <= threshold_s)
            and (threshold_rel is None or threshold_rel >= 1 or lo >= hi * (1.0 - threshold_rel)))


def within_threshold(stage_times: Sequence[float], threshold_s: float | None = None,
                     threshold_rel: float | None = None) -> bool:
    """The threshold rule's balance test (see the module): do stage times pairwise differ little?

    Args:
        stage_times: seconds per stage.
        threshold_s: largest allowed ``max - min`` in seconds, or None.
        threshold_rel: largest allowed ``(max - min) / max``, or None.

    Returns:
        True when every given threshold holds (always for no or one stage).

    Raises:
        ValueError: both thresholds None, or one negative.
    """
    _check_thresholds(threshold_s, threshold_rel)
    return not stage_times or _balanced(min(stage_times), max(stage_times), threshold_s,
                                        threshold_rel)


def _check(clusters: Sequence[ClusterCost], k: int, link_bandwidth: float) -> None:
    bad = [i for i, c in enumerate(clusters) if not c.layers or not math.isfinite(c.time_s)
           or c.time_s < 0 or c.out_bytes < 0]
    if bad or not link_bandwidth > 0:
        raise ValueError(f"need link_bandwidth > 0 and clusters with at least one layer, finite "
                         f"time_s >= 0 and out_bytes >= 0; got link_bandwidth={link_bandwidth}, "
                         f"bad clusters {bad}")
    if sum(c.out_bytes for c in clusters) >= _NONE:
        raise ValueError("out_bytes sum to 2**62 or more; give them in a coarser unit")
    n = len(clusters)
    if k < 1:
        raise PlanError(f"need at least 1 stage, got k={k}; ask for 1 to {n} stages")
    if k > n:
        raise PlanError(f"more stages than clusters: k={k} stages but only {n} clusters; use "
                        f"at most {n} stages, or split the model into finer clusters")


def _segments(clusters: Sequence[ClusterCost]) -> np.ndarray:
    """``seg[i, j]``: time of a stage holding clusters ``i .. j-1`` (NaN unless ``i < j``)."""
    n, times = len(clusters), [c.time_s for c in clusters]
    seg = np.full((n + 1, n + 1), np.nan)
    for i in range(n):
        seg[i, i + 1:] = [math.fsum(times[i:j]) for j in range(i + 1, n + 1)]
    return seg


def _minmax_value(seg: list[list[float]], k: int) -> float:
    """Least largest stage time over all partitions into ``k`` stages (exact: min/max only)."""
    n = len(seg) - 1
    f = [-math.inf] + [math.inf] * n  # f[j]: best over clusters[:j] in the stages so far
    for _ in range(k):
        f = [math.inf] + [min(max(f[i], seg[i][j]) for i in range(j)) for j in range(1, n + 1)]
    return f[n]


def _least_bytes(seg: list[list[float]], out: list[int], k: int, lo: float,
                 hi: float) -> list[int] | None:
    """Sizes of the least-bytes partition with all stage times in ``[lo, hi]``, earliest cuts.

    Suffix DP ``g[s][i]`` = least bytes splitting clusters ``i..n-1`` into ``s + 1`` stages,
    then a walk from the front taking the earliest cut that keeps the optimum (so ties go to
    the lexicographically smallest cuts). None when no partition fits.
    """
    n = len(seg) - 1
    ok = [[lo <= seg[i][j] <= hi if i < j else False for j in range(n + 1)] for i in range(n)]
    g = [[0 if ok[i][n] else math.inf for i in range(n)] + [math.inf]]
    for _ in range(k - 1):
        prev = g[-1]
        g.append([min((out[j - 1] + prev[j] for j in range(i + 1, n) if ok[i][j]),
                      default=math.inf) for i in range(n)] + [math.inf])
    if g[k - 1][0] == math.inf:
        return None
    sizes, i = [], 0  # rows g[s] below: s + 1 stages left, starting at cluster i
    for s in range(k - 1, 0, -1):
        j = next(j for j in range(i + 1, n) if ok[i][j] and out[j - 1] + g[s - 1][j] == g[s][i])
        sizes.append(j - i)
        i = j
    return sizes + [n - i]


def _window_bytes(seg: np.ndarray, out: list[int], k: int, lo: np.ndarray,
                  hi: np.ndarray) -> np.ndarray:
    """Least cut bytes for each window ``[lo[w], hi[w]]`` at once (``_NONE``: none fits)."""
    n = seg.shape[0] - 1
    cost = np.zeros(n + 1, dtype=np.int64)
    cost[1:n] = out[:n - 1]
    allowed = (seg[None] >= lo[:, None, None]) & (seg[None] <= hi[:, None, None])
    f = np.full((len(lo), n + 1), _NONE, dtype=np.int64)
    f[:, 0] = 0
    for _ in range(k):
        f = np.minimum(np.where(allowed, (f + cost)[:, :, None], _NONE).min(axis=1), _NONE)
    return f[:, n]


def _build(clusters: Sequence[ClusterCost], sizes: list[int], link_bandwidth: float,
           rule: str) -> Partition:
    stages, times, i = [], [], 0
    for size in sizes:
        stages.append([layer for c in clusters[i:i + size] for layer in c.layers])
        times.append(math.fsum(c.time_s for c in clusters[i:i + size]))
        i += size
    comm = sum(clusters[c - 1].out_bytes for c in itertools.accumulate(sizes[:-1]))
    return Partition(stages, times, comm / link_bandwidth, max(times), rule, sizes, comm)


def minmax_partition(clusters: Sequence[ClusterCost], k: int,
                     link_bandwidth: float) -> Partition:
    """The partition whose largest stage time is least.

    A bottleneck DP (``min`` of ``max``, exact in floating point, O(k n^2)) finds the optimum
    ``M``; then a least-bytes DP over partitions with every stage ``<= M`` breaks ties by least
    communication, then by earliest cuts (lexicographically smallest :meth:`Partition.cuts`).

    Args:
        clusters, k, link_bandwidth: see the module.

    Returns:
        The partition, with rule ``"minmax"``.

    Raises:
        PlanError: ``k < 1`` or more stages than clusters.
        ValueError: negative or non-finite costs, clusters without layers, bandwidth ``<= 0``.
    """
    _check(clusters, k, link_bandwidth)
    seg = _segments(clusters).tolist()
    top = _minmax_value(seg, k)
    sizes = _least_bytes(seg, [c.out_bytes for c in clusters], k, -math.inf, top)
    return _build(clusters, sizes, link_bandwidth, "minmax")


def seed_partition(clusters: Sequence[ClusterCost], k: int, link_bandwidth: float,
                   threshold_s: float | None = None,
                   threshold_rel: float | None = None) -> Partition:
    """The adaptive pipeline's rule: least communication among balanced partitions, else min-max.

    Among all partitions into ``k`` stages whose stage times are balanced (see the module), take
    the one of least ``comm_bytes``; ties go to the least ``max_time``, then to the earliest
    cuts. If none is balanced, return :func:`minmax_partition` (rule ``"minmax"``).

    Exact without enumerating the ``C(n-1, k-1)`` partitions: a partition's stage times are
    segment sums, so its (min, max) is a pair of the O(n^2) segment values. For each candidate
    ``hi`` (ascending, from the min-max optimum up) let ``lo(hi)`` be the least segment value
    with ``_balanced(lo, hi)``; every partition with all stage times in ``[lo(hi), hi]`` is
    balanced (the test is monotone) and every balanced partition with max ``hi`` lies in that
    window, so the balanced partitions are exactly the union of the windows. A least-bytes DP
    per window (numpy, batched over windows; windows whose ``lo`` exceeds the max-min optimum
    hold nothing and are skipped, and the scan stops early at a window reaching the
    unconstrained least bytes) gives the optimum ``B``. The first window (least ``hi``)
    reaching ``B`` has ``hi`` = the least max time among balanced ``B``-byte partitions, and
    holds exactly those; one exact DP in it picks the earliest cuts. O(k n^2) per window, at
    most O(n^2) windows: n = 64, k = 8 takes ~0.1 s at worst.

    Args:
        clusters, k, link_bandwidth: see the module.
        threshold_s: largest allowed ``max - min`` stage time in seconds, or None.
        threshold_rel: largest allowed ``(max - min) / max``, or None (both: both must hold).

    Returns:
        The partition, with rule ``"threshold"`` or, on fallback, ``"minmax"``.

    Raises:
        PlanError: ``k < 1`` or more stages than clusters.
        ValueError: bad costs or bandwidth (as :func:`minmax_partition`), both thresholds None,
            or a negative threshold.
    """
    _check(clusters, k, link_bandwidth)
    _check_thresholds(threshold_s, threshold_rel)
    seg_np = _segments(clusters)
    seg, out = seg_np.tolist(), [c.out_bytes for c in clusters]
    top = _minmax_value(seg, k)  # no partition has a smaller max
    floor = -_minmax_value((-seg_np).tolist(), k)  # ... nor a larger min
    values = sorted({v for row in seg for v in row if not math.isnan(v)})
    windows, p = [], 0
    for hi in (v for v in values if v >= top):
        while not _balanced(values[p], hi, threshold_s, threshold_rel):
            p += 1  # lo(hi) never decreases as hi grows; _balanced(hi, hi) always holds
        if values[p] > floor:
            break
        windows.append((values[p], hi))
    free = _window_bytes(seg_np, out, k, np.array([-np.inf]), np.array([np.inf]))[0]
    best, first = _NONE, None
    for start in range(0, len(windows), _BATCH):
        lo, hi = np.array(windows[start:start + _BATCH]).T
        found = _window_bytes(seg_np, out, k, lo, hi)
        w = int(np.argmin(found))
        if found[w] < best:
            best, first = int(found[w]), windows[start + w]
        if best == free:
            break
    if first is None:
        return minmax_partition(clusters, k, link_bandwidth)
    return _build(clusters, _least_bytes(seg, out, k, *first), link_bandwidth, "threshold")
