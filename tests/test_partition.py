"""Tests for trainwright.plan.partition: clusters into stages, threshold rule and min-max."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from trainwright.errors import PlanError
from trainwright.plan.partition import (
    ClusterCost,
    Partition,
    imbalance,
    minmax_partition,
    seed_partition,
    within_threshold,
)

BW = 10.0  # link bandwidth, bytes/s: a 100-byte cut costs 10 s


def _clusters(times: list[float], out: list[int]) -> list[ClusterCost]:
    """One cluster per entry; cluster ``i`` holds layers ``2i, 2i+1``."""
    pairs = enumerate(zip(times, out, strict=True))
    return [ClusterCost((2 * i, 2 * i + 1), t, b) for i, (t, b) in pairs]


def _all_partitions(clusters: list[ClusterCost], k: int):
    """Every partition as ``(cuts, stage_times, comm_bytes)``, cuts in increasing order."""
    n = len(clusters)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        times = [math.fsum(c.time_s for c in clusters[a:b]) for a, b in itertools.pairwise(bounds)]
        yield list(cuts), times, sum(clusters[c - 1].out_bytes for c in cuts)


def _brute_minmax(clusters, k):
    return min(_all_partitions(clusters, k), key=lambda p: (max(p[1]), p[2], p[0]))


def _brute_seed(clusters, k, threshold_s, threshold_rel):
    def balanced(times):
        lo, hi = min(times), max(times)
        return ((threshold_s is None or hi - lo <= threshold_s)
                and (threshold_rel is None or threshold_rel >= 1 or lo >= hi * (1 - threshold_rel)))

    ok = [p for p in _all_partitions(clusters, k) if balanced(p[1])]
    if not ok:
        return _brute_minmax(clusters, k), "minmax"
    return min(ok, key=lambda p: (p[2], max(p[1]), p[0])), "threshold"


def _random_table(rng: random.Random, n: int) -> list[ClusterCost]:
    if rng.random() < 0.5:  # small integers: many ties in times and bytes
        return _clusters([float(rng.randint(0, 4)) for _ in range(n)],
                         [rng.randint(0, 3) for _ in range(n)])
    return _clusters([rng.uniform(0.1, 3.0) for _ in range(n)],
                     [rng.randint(0, 10**6) for _ in range(n)])


def _random_cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 9)
        yield rng, _random_table(rng, n), rng.randint(1, min(4, n))


@pytest.mark.timeout(60)
def test_minmax_matches_brute_force():
    for _, clusters, k in _random_cases(seed=0, count=150):
        cuts, times, comm = _brute_minmax(clusters, k)
        got = minmax_partition(clusters, k, BW)
        assert got.max_time == max(times)
        assert (got.cuts(), got.comm_bytes, got.rule) == (cuts, comm, "minmax")
        assert got.stage_times == times and got.comm_s == comm / BW


@pytest.mark.timeout(60)
def test_seed_rule_matches_brute_force():
    rules = set()
    for rng, clusters, k in _random_cases(seed=1, count=300):
        total = math.fsum(c.time_s for c in clusters)
        kind = rng.choice(["abs", "rel", "both"])
        threshold_s = rng.uniform(0, total / k) if kind != "rel" else None
        threshold_rel = rng.choice([0.0, 0.1, rng.uniform(0, 0.8), 1.0]) if kind != "abs" else None
        (cuts, times, comm), rule = _brute_seed(clusters, k, threshold_s, threshold_rel)
        got = seed_partition(clusters, k, BW, threshold_s, threshold_rel)
        assert (got.rule, got.comm_bytes, got.max_time) == (rule, comm, max(times))
        assert got.cuts() == cuts and got.stage_times == times
        if rule == "threshold":
            assert within_threshold(got.stage_times, threshold_s, threshold_rel)
            assert threshold_rel is None or imbalance(got.stage_times) <= threshold_rel + 1e-12
        rules.add(rule)
    assert rules == {"threshold", "minmax"}


@pytest.mark.timeout(60)
def test_hand_worked_example():
    # Times 4, 1, 3, 2 s; a cut after cluster 0 / 1 / 2 sends 100 / 300 / 50 bytes (BW 10 B/s).
    #   cuts  stages        times   (max-min)/max   bytes
    #   [1]   [0] [1 2 3]   4 | 6   2/6 = 0.33      100
    #   [2]   [0 1] [2 3]   5 | 5   0               300
    #   [3]   [0 1 2] [3]   8 | 2   6/8 = 0.75       50
    # threshold_rel = 0.5 keeps [1] and [2]; the cheaper is [1] (10 s), although [3] is the
    # cheapest of all and [2] is the min-max optimum.
    clusters = _clusters([4.0, 1.0, 3.0, 2.0], [100, 300, 50, 0])
    p = seed_partition(clusters, 2, BW, threshold_rel=0.5)
    assert p.stages == [[0, 1], [2, 3, 4, 5, 6, 7]] and p.cuts() == [1] and p.sizes == [1, 3]
    assert (p.stage_times, p.comm_bytes, p.comm_s, p.max_time, p.rule) == (
        [4.0, 6.0], 100, 10.0, 6.0, "threshold")
    # threshold_rel = 0.1 keeps only [2]; so does threshold_s = 1 with threshold_rel = 0.5.
    assert seed_partition(clusters, 2, BW, threshold_rel=0.1).cuts() == [2]
    assert seed_partition(clusters, 2, BW, threshold_s=1.0, threshold_rel=0.5).cuts() == [2]
    # No cap on the spread but a huge absolute one: every partition qualifies, [3] wins.
    assert seed_partition(clusters, 2, BW, threshold_s=100.0).cuts() == [3]
    assert minmax_partition(clusters, 2, BW).cuts() == [2]
    # Times 4, 1, 3, 3: the splits give 4|7, 5|6, 8|3, all differing by > 0.5 s, so the rule
    # falls back to the min-max optimum 5|6.
    clusters = _clusters([4.0, 1.0, 3.0, 3.0], [100, 300, 50, 0])
    p = seed_partition(clusters, 2, BW, threshold_s=0.5)
    assert (p.cuts(), p.stage_times, p.rule) == ([2], [5.0, 6.0], "minmax")


@pytest.mark.timeout(60)
def test_minmax_ties_go_to_less_communication_then_earliest_cuts():
    # 1 | 1 | 1 | 1 into 2 stages: max 2 only with cut [2]; into 3 stages max 2 with cuts
    # [1, 2], [1, 3], [2, 3]; bytes 5 + 1, 5 + 1, 1 + 1 -> [2, 3].
    clusters = _clusters([1.0] * 4, [5, 1, 1, 0])
    assert minmax_partition(clusters, 3, BW).cuts() == [2, 3]
    clusters = _clusters([1.0] * 4, [1, 1, 1, 0])
    assert minmax_partition(clusters, 3, BW).cuts() == [1, 2]


@pytest.mark.timeout(60)
def test_k_equal_n_and_k_one():
    clusters = _clusters([1.0, 2.0, 3.0], [7, 8, 9])
    for p in (minmax_partition(clusters, 3, BW), seed_partition(clusters, 3, BW, threshold_s=0)):
        assert p.stages == [[0, 1], [2, 3], [4, 5]] and p.sizes == [1, 1, 1]
        assert p.cuts() == [1, 2] and p.comm_bytes == 15 and p.stage_times == [1.0, 2.0, 3.0]
    assert seed_partition(clusters, 3, BW, threshold_s=0).rule == "minmax"
    one = seed_partition(clusters, 1, BW, threshold_rel=0.0)
    assert (one.stages, one.cuts(), one.comm_s, one.rule) == ([[0, 1, 2, 3, 4, 5]], [], 0.0,
                                                              "threshold")


@pytest.mark.timeout(60)
def test_more_stages_than_clusters():
    clusters = _clusters([1.0, 2.0, 3.0], [1, 1, 1])
    with pytest.raises(PlanError, match=r"more stages than clusters: k=4 stages but only 3 "
                                        r"clusters; use at most 3 stages, or split"):
        minmax_partition(clusters, 4, BW)
    with pytest.raises(PlanError, match="more stages than clusters"):
        seed_partition(clusters, 5, BW, threshold_rel=0.1)
    with pytest.raises(PlanError, match="at least 1 stage, got k=0"):
        minmax_partition(clusters, 0, BW)


@pytest.mark.timeout(60)
def test_invalid_inputs():
    good = _clusters([1.0, 2.0], [1, 1])
    for bad in (_clusters([-1.0, 2.0], [1, 1]), _clusters([1.0, 2.0], [-1, 1]),
                _clusters([math.nan, 2.0], [1, 1]), [ClusterCost((), 1.0, 1)]):
        with pytest.raises(ValueError, match="finite time_s >= 0 and out_bytes >= 0"):
            minmax_partition(bad, 1, BW)
    for bw in (0.0, -1.0):
        with pytest.raises(ValueError, match="link_bandwidth > 0"):
            seed_partition(good, 1, bw, threshold_s=1.0)
    with pytest.raises(ValueError, match="both are None"):
        seed_partition(good, 1, BW)
    with pytest.raises(ValueError, match="threshold_rel must be >= 0"):
        seed_partition(good, 1, BW, threshold_rel=-0.1)


@pytest.mark.timeout(60)
def test_imbalance_and_within_threshold():
    assert imbalance([]) == 0.0 and imbalance([0.0, 0.0]) == 0.0
    assert imbalance([2.0, 4.0, 3.0]) == 0.5
    assert within_threshold([2.0, 4.0], threshold_rel=0.5)
    assert not within_threshold([2.0, 4.0], threshold_rel=0.49)
    assert not within_threshold([2.0, 4.0], threshold_s=3.0, threshold_rel=0.4)
    assert within_threshold([2.0, 4.0], threshold_s=2.0) and within_threshold([], threshold_s=0)
    assert within_threshold([0.0, 5.0], threshold_rel=math.inf)


@pytest.mark.timeout(60)
def test_cuts_and_partition_fields():
    p = Partition([[0], [1, 2], [3]], [1.0, 2.0, 1.0], 0.5, 2.0, "minmax", [1, 2, 1], 5)
    assert p.cuts() == [1, 3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{"threshold_rel": 0.02}, {"threshold_rel": 0.2},
                                    {"threshold_rel": 0.6}, {"threshold_s": 4.0},
                                    {"threshold_s": 0.3, "threshold_rel": 0.1}])
def test_64_clusters_8_stages_is_fast(kwargs):
    rng = random.Random(7)
    clusters = _clusters([rng.uniform(0.5, 2.0) for _ in range(64)],
                         [rng.randint(1, 10**6) for _ in range(64)])
    start = time.perf_counter()
    p = seed_partition(clusters, 8, 1e9, **kwargs)
    assert time.perf_counter() - start < 2.0
    assert len(p.stages) == 8 and sum(p.sizes) == 64
    assert p.rule == "minmax" or within_threshold(p.stage_times, **kwargs)
    assert p.max_time >= minmax_partition(clusters, 8, 1e9).max_time
