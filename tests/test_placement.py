"""Peer-swap placement: chunking by bandwidth, the rules, spare memory, the mapping search."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwright.plan.devices import DeviceTopology, parse_nvidia_smi_topo, preset
from trainwright.plan.memory import LayerMem
from trainwright.plan.placement import (
    HOST,
    Rules,
    StageMem,
    TensorInfo,
    brute_force_mappings,
    place,
    search_mappings,
    split_by_bandwidth,
    stage_required,
)

pytestmark = pytest.mark.timeout(60)


@given(st.integers(0, 10**12), st.lists(st.floats(0, 1e12), min_size=1, max_size=8))
@settings(max_examples=300, deadline=None)
def test_chunks_proportional_and_sum_exactly(nbytes, bws):
    if sum(bws) <= 0:
        with pytest.raises(ValueError):
            split_by_bandwidth(nbytes, bws)
        return
    sizes = split_by_bandwidth(nbytes, bws)
    assert sum(sizes) == nbytes
    total = sum(bws)
    for n, b in zip(sizes, bws, strict=True):
        assert abs(n - nbytes * b / total) < 1.0 + 1e-6 * nbytes  # within one byte (rounding)
        assert n >= 0


def test_chunks_exact_ratios():
    assert split_by_bandwidth(600, [50e9, 25e9, 25e9]) == [300, 150, 150]
    assert split_by_bandwidth(10, [1, 1, 1]) == [4, 3, 3]  # remainder to the first tie
    assert split_by_bandwidth(7, [0, 2]) == [0, 7]


def _stage(stage, in_flight, tensors, budget, fwd=0.01, inp=1000, n_micro=0):
    layers = sorted({t.layer for t in tensors})
    mems = [LayerMem(ly, sum(t.nbytes for t in tensors if t.layer == ly), inp, fwd, 2 * fwd)
            for ly in layers]
    return StageMem(stage, in_flight, mems, tensors, budget, n_micro)


def _line_bw(n, fast=50e9):
    return [[0.0 if i == j else fast / (1 + abs(i - j)) for j in range(n)] for i in range(n)]


def test_short_interval_goes_to_peers_long_to_host():
    tensors = [TensorInfo(0, 0, 4000, interval_s=0.5), TensorInfo(1, 0, 4000, interval_s=100.0)]
    heavy = _stage(0, 2, tensors, budget=2 * 2000 + 4000 + 4000)
    light = [_stage(s, 1, [TensorInfo(10 + s, 0, 100, 1.0)], budget=10**6) for s in (1, 2)]
    pl = place([heavy, *light], [0, 1, 2], _line_bw(3), host_bandwidth=1e9,
               rules=Rules(short_s=1.0, long_s=10.0))
    pols = {(t.layer, t.index): t for t in pl.stages[0].tensors}
    assert pols[(0, 0)].policy == "peer" and pols[(1, 0)].policy == "host"
    # chunks follow the link bandwidths to stages 1 and 2 (50/2 : 50/3 GB/s) and sum exactly
    chunks = pols[(0, 0)].chunks
    assert [c.target for c in chunks] == [1, 2]
    assert sum(c.nbytes for c in chunks) == 4000
    assert chunks[0].nbytes == pytest.approx(4000 * 3 / 5, abs=1)
    assert pl.stages[0].fits


def test_chunk_too_slow_for_interval_falls_back_to_cheaper_of_host_and_recompute():
    # interval 1 us; a 1 MB chunk over a 1 GB/s link needs 2 ms round trip: too slow
    t = TensorInfo(0, 0, 10**6, interval_s=1e-6)
    bw = [[0, 1e9], [1e9, 0]]
    # recompute (1 ms) beats host (2 * 1e6 / 1e8 = 20 ms)
    heavy = _stage(0, 1, [t], budget=10**5, fwd=1e-3)
    pl = place([heavy, _stage(1, 1, [], budget=10**9)], [0, 1], bw, host_bandwidth=1e8,
               rules=Rules(short_s=1.0))
    assert pl.stages[0].tensors[0].policy == "recompute"
    # host (2 ms at 1 GB/s) beats recompute (1 s)
    heavy = _stage(0, 1, [t], budget=10**5, fwd=1.0)
    pl = place([heavy, _stage(1, 1, [], budget=10**9)], [0, 1], bw, host_bandwidth=1e9,
               rules=Rules(short_s=1.0))
    assert pl.stages[0].tensors[0].policy == "host"
    assert pl.stages[0].tensors[0].chunks[0].target == HOST


def _random_case(rng: random.Random, n_stages: int):
    stages = []
    for s in range(n_stages):
        tensors = [TensorInfo(s * 10 + ly, k, rng.randint(1, 5000), rng.uniform(0, 0.01))
                   for ly in range(rng.randint(1, 3)) for k in range(rng.randint(1, 3))]
        keep = stage_required(_stage(s, n_stages - s, tensors, None), {})
        budget = int(keep * rng.uniform(0.3, 1.6))
        stages.append(_stage(s, n_stages - s, tensors, budget, fwd=rng.uniform(1e-6, 1e-3),
                             n_micro=rng.choice([0, n_stages + 2])))
    return stages


def test_never_more_on_a_peer_than_its_spare():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 5)
        stages = _random_case(rng, n)
        bw = [[0.0 if i == j else rng.choice([0.0, 1e9, 5e9, 25e9]) for j in range(n)]
              for i in range(n)]
        mapping = rng.sample(range(n), n)
        pl = place(stages, mapping, bw, host_bandwidth=rng.choice([1e8, 1e9]),
                   rules=Rules(short_s=rng.choice([None, 1.0])))
        held = {d: 0 for d in mapping}
        for sp, st_ in zip(pl.stages, stages, strict=True):
            for t in sp.tensors:
                assert sum(c.nbytes for c in t.chunks) in (0, t.nbytes)
                for c in t.chunks:
                    if c.target >= 0:
                        assert c.target in mapping[st_.stage + 1:]  # later stages only
                        held[c.target] += c.nbytes * st_.peer_slots
        for d, h in held.items():
            assert h == pl.peer_held[d]
            assert h <= pl.spare[d]
        for sp, st_ in zip(pl.stages, stages, strict=True):  # a peer's own need + held <= budget
            if held[sp.device]:
                assert sp.required_bytes + held[sp.device] <= st_.budget


def _sym_topologies():
    yield "dgx1-half", [row[:4] for row in preset("dgx1").bandwidth[:4]]
    yield "pcie4", [row[:4] for row in preset("pcie8").bandwidth[:4]]
    rng = random.Random(3)
    for _ in range(6):
        n = rng.randint(3, 6)
        bw = [[0.0] * n for _ in range(n)]
        for i, j in itertools.combinations(range(n), 2):
            bw[i][j] = bw[j][i] = rng.choice([0.0, 25e9, 50e9])
        yield f"random{n}", bw


@pytest.mark.parametrize("name,bw", list(_sym_topologies()))
def test_mapping_search_equals_brute_force(name, bw):
    rng = random.Random(name)
    n = len(bw)
    topo = DeviceTopology(name, [1] * n, bw, [1e9] * n)
    group = topo.automorphisms()
    assert tuple(range(n)) in group
    for n_stages in range(2, n + 1):
        for _ in range(3):
            stages = _random_case(rng, n_stages)
            best = search_mappings(stages, bw, group)[0]
            assert best == brute_force_mappings(stages, bw)
            # pruning scores no more than one mapping per orbit
            every = search_mappings(stages, bw, group, top=10**6)
            assert len(every) <= len(list(itertools.permutations(range(n), n_stages)))


def test_symmetry_pruning_shrinks_search():
    topo = preset("nvswitch8")
    assert len(topo.automorphisms()) == 40320
    stages = _random_case(random.Random(1), 8)
    assert len(search_mappings(stages, topo.bandwidth, topo.automorphisms(), top=100)) == 1
    dgx = preset("dgx1")
    group = dgx.automorphisms()
    n_maps = len(search_mappings(stages, dgx.bandwidth, group, top=10**6))
    assert 1 < n_maps < 40320 and n_maps * len(group) >= 40320


def test_nvidia_smi_parse_matches_dgx1_preset():
    rows = ["\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity"]
    d = preset("dgx1")
    for i in range(8):
        cells = ["X" if i == j else (f"NV{int(d.bandwidth[i][j] / 25e9)}"
                                     if d.bandwidth[i][j] else "SYS") for j in range(8)]
        rows.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-19")
    parsed = parse_nvidia_smi_topo("\n".join(rows), 32 * 2**30)
    for i in range(8):
        for j in range(8):
            if d.bandwidth[i][j]:
                assert parsed.bandwidth[i][j] == d.bandwidth[i][j]
            elif i != j:
                assert 0 < parsed.bandwidth[i][j] < 25e9
    assert sum(1 for j in range(8) if d.bandwidth[0][j]) == 4
    assert sum(d.bandwidth[0]) == 6 * 25e9  # six NVLinks per V100


# ------------------------------------------------------- plan --model SPEC: candidates
def test_bytes_per_param_by_precision_and_optimizer():
    from trainwright.plan.candidates import bytes_per_param

    assert bytes_per_param(2, "adamw").total == 16  # bf16 + fp32 master + two fp32 moments
    assert bytes_per_param(4, "adam").total == 16  # fp32: weights, grads, two moments
    assert bytes_per_param(4, "sgd").total == 8
    assert bytes_per_param(4, "sgd", momentum=True).total == 12
    assert bytes_per_param(2, "sgd").optimizer == 4  # the master copy alone


def test_candidates_cover_every_schedule_and_say_what_is_left_out():
    from trainwright.plan.candidates import enumerate_candidates

    cands, skipped = enumerate_candidates(16, 8, 34, 256, [1, 2])
    assert {c.pp for c in cands} == {1, 2, 4, 8, 16}
    assert all(c.pp * c.dp == 16 and c.dp * c.micro_batch_size * c.micro_batches == 256
               for c in cands)
    assert {c.schedule for c in cands if c.pp == 4} == {
        "1f1b", "gpipe", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"}
    assert {c.virtual_stages for c in cands if c.schedule == "interleaved-1f1b"} == {2, 3, 4}
    assert all(c.peer_swap == (c.schedule in ("1f1b", "gpipe")) for c in cands)
    # 16 x 3 chunks need 48 layers; the model has 34
    assert any(s["pp"] == 16 and s["virtual_stages"] == 3 for s in skipped)
    _, bad = enumerate_candidates(4, 4, 8, 6, [4])
    assert bad and all("does not split" in s["skipped"] for s in bad)


def test_sync_time_crosses_nodes_only_when_replicas_do():
    from trainwright.plan.candidates import sync_time
    from trainwright.plan.devices import cluster, preset

    topo = cluster(preset("nvswitch8", 2**30), 2, 25e9)
    assert sync_time(1e9, 4, 1, topo) == 0.0
    assert sync_time(1e9, 2, 4, topo) == pytest.approx(2 * 3 / 4 * 1e9 / 300e9)  # in a node
    assert sync_time(1e9, 4, 4, topo) == pytest.approx(2 * 3 / 4 * 1e9 / 25e9)  # across


def test_mapping_becomes_rank_order_inside_a_replica():
    from trainwright.cli.plan_model import _local_order

    assert _local_order([0, 1, 3, 2]) == [0, 1, 3, 2]
    assert _local_order([4, 6, 5, 7]) == [0, 2, 1, 3]  # devices of the second node
