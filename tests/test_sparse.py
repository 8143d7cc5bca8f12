"""Sparse gradient sync equals a dense all-reduce of the same gradients.

Every multi-process test spawns one gloo group and runs many cases inside it (importing
torch dominates start-up here). Each rank can compute every rank's gradients from the case
definition, but the oracle is the real thing: ``dist.all_reduce`` of the dense gradients.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainwright.config import load_config
from trainwright.dist.testing import run_workers
from trainwright.errors import ConfigError
from trainwright.sync.sparse import (
    LinkModel,
    RowSparse,
    SparseGradSync,
    calibrate,
)
from trainwright.sync.sparse_cost import (
    MAD_TO_SE,
    MIN_SAMPLES,
    REMEASURE_STEPS,
    CostHistory,
    PathChoice,
    density_moved,
    size_band,
    sticky_path,
)
from trainwright.sync.sparse_ddp import SparseDataParallel

# Constants of the order measured here (DESIGN facts: 1M x 64 fp32, 4 ranks)
LINK = LinkModel(latency_s=2e-4, bandwidth=1.0e9, allreduce_bandwidth=0.8e9, merge_rate=1.5e9)
HEIGHT, DIM = 40, 3
CASES = ("equal", "unequal", "zero_rank", "nobody", "duplicates", "overlap", "all_rows",
         "one_rank")
PATH_NAMES = ("auto", "allgather", "broadcast", "dense")


def _case_ids(case: str, rank: int, world: int) -> torch.Tensor:
    """Row ids (with repeats where the case wants them) that ``rank`` touches."""
    g = torch.Generator().manual_seed(1000 * CASES.index(case) + rank)
    if case == "equal":  # disjoint blocks of 5 distinct rows
        return torch.randperm(HEIGHT // world, generator=g)[:5] * world + rank
    if case == "unequal":
        return torch.randperm(HEIGHT, generator=g)[: 2 + 3 * rank]
    if case == "zero_rank":
        return (torch.empty(0, dtype=torch.int64) if rank == 1
                else torch.randperm(HEIGHT, generator=g)[:7])
    if case == "nobody":
        return torch.empty(0, dtype=torch.int64)
    if case == "duplicates":  # every id three times within the rank
        return torch.randperm(HEIGHT, generator=g)[:4].repeat(3)
    if case == "overlap":  # rows 0..9 on every rank plus a few of its own
        return torch.cat([torch.arange(10), 10 + torch.randperm(HEIGHT - 10, generator=g)[:3]])
    if case == "all_rows":
        return torch.cat([torch.arange(HEIGHT), torch.randint(0, HEIGHT, (5,), generator=g)])
    if case == "one_rank":  # the textbook case: only one rank has rows
        return torch.randperm(HEIGHT, generator=g)[:9] if rank == 0 else torch.empty(0).long()
    raise AssertionError(case)


def _case_grad(case: str, rank: int, world: int, id_dtype: torch.dtype) -> torch.Tensor:
    ids = _case_ids(case, rank, world).to(id_dtype)
    g = torch.Generator().manual_seed(77 + rank)
    vals = torch.randn(ids.numel(), DIM, generator=g, dtype=torch.float64).float()
    return torch.sparse_coo_tensor(ids.long().unsqueeze(0), vals, (HEIGHT, DIM),
                                   check_invariants=True), ids, vals


def _dense_oracle(dense: torch.Tensor, world: int) -> torch.Tensor:
    out = dense.clone()
    dist.all_reduce(out)
    return out / world


def _exchange_worker(rank: int, world: int) -> None:
    link = calibrate()
    got = torch.tensor([link.latency_s, link.bandwidth, link.allreduce_bandwidth,
                        link.merge_rate], dtype=torch.float64)
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    assert all(torch.equal(e, got) for e in every), "ranks calibrated different models"
    assert all(v > 0 for v in got.tolist())
    for case in CASES:
        for id_dtype in (torch.int32, torch.int64):
            coo, ids, vals = _case_grad(case, rank, world, id_dtype)
            dense = coo.to_dense()
            want = _dense_oracle(dense, world)
            lin_grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
            lin_want = _dense_oracle(lin_grad, world)
            for path in PATH_NAMES:
                for kind in ("coo", "dense", "none_if_empty"):
                    label = f"{case} {id_dtype} {path} {kind} rank {rank}"
                    emb, lin = nn.Embedding(HEIGHT, DIM, sparse=kind == "coo"), nn.Linear(5, 4)
                    if kind == "none_if_empty" and ids.numel() == 0:
                        emb.weight.grad = None  # unused on this rank: no gradient at all
                    elif kind == "coo":
                        # the triple is built from the raw (uncoalesced) ids as given
                        emb.weight.grad = torch.sparse_coo_tensor(
                            ids.unsqueeze(0), vals, (HEIGHT, DIM), check_invariants=False)
                    else:
                        emb.weight.grad = dense.clone()
                    lin.weight.grad = lin_grad.clone()
                    sync = SparseGradSync(None, world, path=path, link=link)
                    sync.watch([emb])
                    choices = sync.sync([emb.weight, lin.weight])
                    torch.testing.assert_close(lin.weight.grad, lin_want, msg=label)
                    out = emb.weight.grad
                    if kind == "coo":
                        assert out.is_sparse and out.is_coalesced(), label
                        rows = out.indices()[0]
                        assert torch.equal(rows, rows.unique()), label
                        out = out.to_dense()
                    torch.testing.assert_close(out, want, msg=lambda m, la=label: f"{la}: {m}")
                    assert len(choices) == 1, label
                    c = choices[0]
                    counts = [_case_ids(case, r, world).unique().numel() for r in range(world)]
                    if kind != "coo":  # dense input: rows with an exactly-zero sum are dropped
                        counts = [int(_case_grad(case, r, world, id_dtype)[0].to_dense()
                                      .ne(0).any(1).sum()) for r in range(world)]
                    assert list(c.counts) == counts, (label, c)
                    if sum(counts) == 0:
                        assert c.path == "none", label
                    elif path == "auto":
                        assert c.path == min(c.estimates_s, key=c.estimates_s.get), label
                    else:
                        assert c.path == path, label
    _dense_block_reuse(rank, world, link)


def _dense_block_reuse(rank: int, world: int, link) -> None:
    """The dense path's block is reused once the gradient made from it is gone, never before."""
    sync = SparseGradSync(None, world, path="dense", link=link)
    emb = nn.Embedding(HEIGHT, DIM, sparse=True)
    sync.watch([emb])
    held, ptrs = [], []
    for step, case in enumerate(("overlap", "unequal", "all_rows", "one_rank")):
        coo = _case_grad(case, rank, world, torch.int64)[0]
        want = _dense_oracle(coo.to_dense(), world)
        emb.weight.grad = coo
        sync.sync([emb.weight])
        got = emb.weight.grad
        torch.testing.assert_close(got.to_dense(), want)
        # what was sent: the mark plus the union's rows, not the estimate's upper bound
        sent = 2 * (world - 1) / world * (HEIGHT + got._nnz() * DIM * 4)
        assert sync.last[0].bytes_sent_per_rank == pytest.approx(sent)
        ptrs.append(got.values().data_ptr())
        if step == 0:
            held.append((got, want))  # still alive during step 1
        emb.weight.grad = got = None
    old, old_want = held[0]
    torch.testing.assert_close(old.to_dense(), old_want)  # untouched by the later steps
    assert ptrs[1] != ptrs[0] and ptrs[2] == ptrs[1] == ptrs[3], ptrs
    _dense_path_reduces_the_gradient_itself(rank, world, link)


def _dense_path_reduces_the_gradient_itself(rank: int, world: int, link) -> None:
    """The dense path all-reduces the storage that becomes the gradient: no table-sized
    buffer besides it, no copy after the collective (as a plain ``dist.all_reduce``)."""
    from trainwright.dist import collective

    reduced = []
    plain = collective.all_reduce

    def spy(tensor, *args, **kwargs):
        reduced.append((tensor.untyped_storage().data_ptr(), tensor.numel(), tensor.dtype))
        return plain(tensor, *args, **kwargs)

    collective.all_reduce = spy
    first = []
    try:
        for kind in ("coo", "dense"):
            sync = SparseGradSync(None, world, path="dense", link=link)
            emb = nn.Embedding(HEIGHT, DIM, sparse=kind == "coo")
            sync.watch([emb])
            for step in range(3):
                coo = _case_grad("all_rows", rank, world, torch.int64)[0]  # union: every row
                want = _dense_oracle(coo.to_dense(), world)
                emb.weight.grad = coo if kind == "coo" else coo.to_dense()
                reduced.clear()
                sync.sync([emb.weight])
                got = emb.weight.grad
                values = got._values() if kind == "coo" else got
                floats = [r for r in reduced if r[2] == torch.float32]
                # one float all-reduce, of the whole table, into the gradient's own storage
                assert floats == [(values.untyped_storage().data_ptr(), HEIGHT * DIM,
                                   torch.float32)], (kind, step, reduced)
                if kind == "coo":  # plus the one-byte-per-row mark, nothing else
                    assert [r[1:] for r in reduced if r[2] != torch.float32] == [
                        (HEIGHT, torch.uint8)], reduced
                    # the same buffer every step: no new table-sized allocation
                    first.append(values.untyped_storage().data_ptr())
                    assert first == first[:1] * len(first), first
                else:
                    assert not [r for r in reduced if r[2] != torch.float32], reduced
                torch.testing.assert_close(got.to_dense() if kind == "coo" else got, want)
                emb.weight.grad = got = values = None
    finally:
        collective.all_reduce = plain


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_sparse_sync_equals_dense_all_reduce(world):
    run_workers(_exchange_worker, world, timeout_s=220)


def _carried_rows_worker(rank: int, world: int) -> None:
    """From the second step on, the rows of an ``allgather`` parameter travel with the
    counts: one all-gather a step instead of two, the same sums; a rank with more rows than
    the capacity (last step's largest count plus headroom), or a rank where the parameter
    is not row-sparse, makes it exchanged again after the counts, still exactly."""
    from trainwright.sync import sparse_exchange

    calls = []
    plain = sparse_exchange.all_gather_into

    def spy(out, inp, group=None):
        calls.append(inp.numel())
        return plain(out, inp, group=group)

    sparse_exchange.all_gather_into = spy
    # rank 0's rows: 5 (equal), 13 (overlap: fits 5 + 16), 40 (all_rows: more than
    # 13 + 16), 13, then a dense gradient on rank 1 (the table is not watched: row-sparse
    # on rank 0 only, sent dense), then 5 (equal). Every rank has rows at every step (with
    # one sender, one broadcast sends half the bytes of an all-gather padded for two)
    steps = [("equal", "coo", 2), ("overlap", "coo", 1), ("all_rows", "coo", 2),
             ("overlap", "coo", 1), ("overlap", "dense_on_rank_1", 1), ("equal", "coo", 1)]
    taken = {}
    try:
        # auto on links where latency is all: one all-gather beats two broadcasts or two
        # all-reduces at any count, and nothing else is measured (explore 0), so it holds
        slow = dataclasses.replace(LINK, latency_s=1e-2)
        for path in ("allgather", "auto"):
            sync = SparseGradSync(None, world, path=path, link=slow, explore=0)
            emb, lin = nn.Embedding(HEIGHT, DIM, sparse=True), nn.Linear(5, 4)
            for step, (case, kind, collectives) in enumerate(steps):
                coo = _case_grad(case, rank, world, torch.int64)[0]
                want = _dense_oracle(coo.to_dense(), world)
                emb.weight.grad = coo.to_dense() if kind == "dense_on_rank_1" and rank == 1 \
                    else coo
                lin.weight.grad = torch.ones(4, 5)
                calls.clear()
                sync.sync([emb.weight, lin.weight])
                label = f"{path} step {step} {case} {kind} rank {rank}: {sync.last}"
                got = emb.weight.grad
                torch.testing.assert_close(got.to_dense() if got.is_sparse else got, want,
                                           msg=lambda m, la=label: f"{la}: {m}")
                assert len(calls) == collectives, (label, calls)
                taken[path, step] = sync.last[0].path if sync.last else "sent dense"
            # the separate count all-gathers' time, the allgather path's credit: the same
            # on every rank (gathered with the counts), so every rank chooses alike
            every = [None] * world
            dist.all_gather_object(every, sync.counts_s)
            assert sync.counts_s > 0 and every == [sync.counts_s] * world, every
    finally:
        sparse_exchange.all_gather_into = plain
    assert all(p in ("allgather", "sent dense") for p in taken.values()), taken


@pytest.mark.timeout(120)
def test_rows_travel_with_the_counts_once_the_path_is_known():
    run_workers(_carried_rows_worker, 2, timeout_s=100)


# --------------------------------------------------------------------- training parity


def _tiny_model(sparse: bool) -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(_BagMean(nn.Embedding(30, 6, sparse=sparse)), nn.Linear(6, 3))


class _BagMean(nn.Module):
    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(ids).mean(dim=1)


def _optimizer(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    emb, rest = [model[0].emb.weight], list(model[1].parameters())
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.5)]
    if name == "sparse_adam":
        return [torch.optim.SparseAdam(emb, lr=0.05), torch.optim.Adam(rest, lr=0.05)]
    return [torch.optim.Adam(model.parameters(), lr=0.05)]


SETUPS = [("sgd", True, "auto"), ("sparse_adam", True, "auto"),
          ("sparse_adam", True, "broadcast"), ("sgd", True, "dense"),
          ("sparse_adam", True, "dense"), ("sparse_adam", True, "allgather"),
          ("adam", False, "auto"), ("adam", False, "allgather"), ("adam", False, "dense")]


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 30, (n, 4), generator=g), torch.randint(0, 3, (n,), generator=g)


def _train(model, opts, steps: int, lo: int, hi: int, n: int) -> None:
    for step in range(1, steps + 1):
        x, y = _batch(step, n)
        loss = nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi])
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()


def _training_worker(rank: int, world: int) -> None:
    n = 4 * world
    for opt, sparse, path in SETUPS:
        ref = _tiny_model(sparse)
        _train(ref, _optimizer(opt, ref), 5, 0, n, n)
        model = SparseDataParallel(_tiny_model(sparse), path=path, link=LINK)
        _train(model, _optimizer(opt, model.module), 5, rank * 4, rank * 4 + 4, n)
        assert model.last_paths, "the embedding went through the sparse path"
        for (name, a), b in zip(model.module.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, msg=lambda m, k=name, o=opt, pa=path: (
                f"{o} {pa} {k}: {m}"))


@pytest.mark.timeout(180)
def test_five_steps_with_sparse_embedding_equal_single_process():
    run_workers(_training_worker, 2, timeout_s=160)


# --------------------------------------------------------------------- pipeline dp groups


class _Paths(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _pipeline_worker(rank: int, world: int, jobs) -> None:
    from trainwright.run.worker import train

    _training_worker(rank, world)  # 4 ranks: the wrapper again, in the same spawn
    sparse_log = logging.getLogger("trainwright.sync.sparse")
    for cfg, run_dir in jobs:
        seen = _Paths()
        sparse_log.addHandler(seen)
        sparse_log.setLevel(logging.INFO)
        train(cfg, Path(run_dir))
        sparse_log.removeHandler(seen)
        steps = [m for m in seen.lines if m.startswith("sparse sync step")]
        if rank % cfg.parallel.pp == 0:  # the stage holding the embedding tables
            assert len(steps) == cfg.train.steps, seen.lines
            # two tables per step (tokens, positions); small tables: auto picks dense
            # auto may mark a path it explores: "dense (measuring it) [98, 97]"
            taken = [p for m in steps for p in re.findall(r"(\w+)(?: \(measuring it\))? \[",
                                                          m.split(":", 1)[1])]
            assert len(taken) == 2 * cfg.train.steps, steps
            if cfg.sync.sparse_path != "auto":
                assert set(taken) == {cfg.sync.sparse_path}, steps
        else:
            assert not steps, steps


@pytest.mark.timeout(300)
def test_pipeline_with_sparse_dp_sync_equals_reference(tiny):
    from trainwright.run.api import load_model
    from trainwright.run.launch import create_run_dir
    from trainwright.run.reference import train_reference

    cfgs = [tiny(**{"parallel.pp": 2, "parallel.dp": 2, "sync.sparse": "true",
                    "train.micro_batches": 2, "sync.sparse_path": f'"{path}"'})
            for path in ("auto", "allgather", "broadcast")]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(_pipeline_worker, 4, list(zip(cfgs, map(str, dirs), strict=True)),
                timeout_s=280)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        ref, _ = train_reference(cfg)
        got = load_model(run_dir)
        for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(a, b, msg=lambda m, n=name, c=cfg: (
                f"{c.sync.sparse_path} {n}: {m}"))


# --------------------------------------------------------------------- pure parts


def test_triple_sums_duplicates_and_round_trips():
    ids = torch.tensor([5, 1, 5, 3, 1, 5], dtype=torch.int32)
    vals = torch.arange(12.0).view(6, 2)
    t = RowSparse.from_ids(ids, vals, height=8)
    assert t.rows.tolist() == [1, 3, 5] and t.rows.dtype == torch.int64
    dense = torch.zeros(8, 2).index_add_(0, ids.long(), vals)
    torch.testing.assert_close(t.to_dense(), dense)
    torch.testing.assert_close(RowSparse.from_coo(t.to_coo()).to_dense(), dense)
    torch.testing.assert_close(RowSparse.from_dense(dense).to_dense(), dense)
    many = torch.randint(0, 8, (64,))  # the bitmap branch (ids * 16 >= height)
    t2 = RowSparse.from_ids(many, torch.ones(64, 2), height=8)
    torch.testing.assert_close(t2.to_dense(), torch.zeros(8, 2).index_add_(0, many,
                                                                           torch.ones(64, 2)))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        RowSparse.from_ids(torch.tensor([8]), torch.ones(1, 2), height=8)




def test_cost_model_picks_the_cheapest_path_at_each_density():
    height, row_bytes, world = 1_000_000, 256, 4
    picked = {}
    for density in (0.001, 0.01, 0.1, 0.5, 1.0):
        c = int(height * density)
        choice = LINK.choose([c] * world, height, row_bytes, world, sparse_input=True)
        est = choice.estimates_s
        assert choice.path == min(est, key=est.get)
        assert all(est[choice.path] <= v for v in est.values())
        picked[density] = choice.path
    assert picked[0.001] == picked[0.01] == "allgather"
    assert picked[0.5] == picked[1.0] == "dense"
    # equal counts: the concurrent trees move what the ring all-gather moves, so broadcast
    # stays within explore's 2x of it and is measured (each tree's rounds in turn: 2.7x)
    est = LINK.estimates([100_000] * world, height, row_bytes, world, True)
    assert est["broadcast"][0] <= 1.1 * est["allgather"][0]
    # one rank holds all rows: a tree broadcast from it beats padding everyone to its size
    skewed = LINK.choose([20_000, 0, 0, 0], height, row_bytes, world, sparse_input=True)
    assert skewed.path == "broadcast"
    # unless the count all-gather it would spare costs more than the broadcast's lead
    lead = skewed.estimates_s["allgather"] - skewed.estimates_s["broadcast"]
    for credit, path in ((0.5 * lead, "broadcast"), (1.2 * lead, "allgather")):
        got = LINK.choose([20_000, 0, 0, 0], height, row_bytes, world, True,
                          allgather_credit_s=credit)
        assert got.path == path, (credit, got)
        assert got.credit_s == {"allgather": pytest.approx(credit)}
        assert got.estimates_s["allgather"] == pytest.approx(
            skewed.estimates_s["allgather"] - credit)
    # a time is learned against the estimate before the credit: 4 s against 1 + 1 s
    # predicted at a factor of 2 is a ratio of 4 (measured / the uncorrected model)
    from trainwright.sync.sparse import SparseGradSync as Sync
    from trainwright.sync.sparse_cost import PathChoice

    credited = PathChoice("allgather", (1, 1), {"allgather": 1.0}, 10.0,
                          factors={"allgather": 2.0}, credit_s={"allgather": 1.0})
    seen: dict = {}
    Sync._observe(credited, time.perf_counter() - 4.0, seen)
    assert seen[("allgather", credited.band)] == pytest.approx(4.0, rel=1e-2)
    assert LINK.choose([0, 0, 0, 0], height, row_bytes, world, True).path == "none"
    forced = LINK.choose([10] * 4, height, row_bytes, world, True, force="dense")
    assert forced.path == "dense" and forced.forced
    # bytes: ring all-gather sends (W-1) x the largest count of (id + row) per rank
    ag = LINK.estimates([100, 50, 0, 0], height, row_bytes, world, True)["allgather"]
    assert ag[1] == 3 * 100 * (row_bytes + 8)
    assert math.isclose(LINK.estimates([1] * 4, 10, 4, 4, False)["dense"][1], 2 * 3 / 4 * 40)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sparse_over_shaped_links_cleans_up():
    import os
    import subprocess

    from trainwright.bench.sparse import SparseBenchSpec, run

    if os.geteuid() != 0:
        pytest.skip("the emulated network needs root")
    spec = SparseBenchSpec(rows=20_000, dim=16, world=2, densities=[0.01, 0.5], repeats=1,
                           network="netns", link_rate="100mbit")
    result = run(spec, timeout_s=250)  # the ranks assert that all systems' gradients agree
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tw{os.getpid() % 100000}" not in left
    assert result["network"].startswith("2 network namespaces, 100mbit")
    sync = {(r["system"], r["density"]): r["sync_s"] for r in result["rows"]}
    # 1.25 MB of table at 100 Mbit/s: the dense all-reduce alone needs >= 0.1 s; at 1 % the
    # triple sends ~1/100 of that
    assert sync["dense_allreduce", 0.01] > 0.08
    assert sync["trainwright", 0.01] < 0.3 * sync["dense_allreduce", 0.01]


def test_touched_rows_of_a_dense_gradient():
    from trainwright.sync.rowsparse import LocalRows, touched_rows

    for dtype in (torch.float32, torch.float16, torch.float64):
        g = torch.zeros(7, 2, 3, dtype=dtype)
        g[1, 0, 2] = 1e-30 if dtype != torch.float16 else 1e-7  # tiny but non-zero
        g[3, 1, 1] = float("nan")
        g[5] = -2.0
        assert touched_rows(g).tolist() == [1, 3, 5]
        assert touched_rows(g.transpose(0, 1).contiguous().transpose(0, 1)).tolist() == [1, 3, 5]
    assert touched_rows(torch.zeros(0, 4)).numel() == 0
    strided = torch.zeros(5, 7).t()  # rows not contiguous: the value test
    strided[2, 4] = 3.0
    assert not strided.is_contiguous() and touched_rows(strided).tolist() == [2]
    # a dense gradient's values are copied out only when a path asks for the triple
    g = torch.zeros(6, 2)
    g[[0, 4]] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    local = LocalRows(dense=g)
    assert local.count == 2 and local._triple is None
    mark = torch.zeros(6, dtype=torch.uint8)
    local.mark(mark)
    assert mark.tolist() == [1, 0, 0, 0, 1, 0] and local._triple is None
    t = local.triple()
    assert t.rows.tolist() == [0, 4]
    torch.testing.assert_close(t.values, g[[0, 4]])


def _history(samples: dict) -> CostHistory:
    """A history fed the given measured / predicted ratios per (path, band)."""
    h = CostHistory()
    for key, ratios in samples.items():
        for r in ratios:
            h.add(key, r)
    return h


def test_a_path_not_yet_measured_at_this_size_is_tried_until_measured_when_close():
    counts, height, row_bytes, world = [100_000] * 4, 1_000_000, 256, 4
    first = LINK.choose(counts, height, row_bytes, world, True, explore=2.0)
    est = first.estimates_s
    assert first.path == min(est, key=est.get) and not first.explored
    close = sorted(k for k in est if k != first.path and est[k] <= 2.0 * est[first.path])
    assert close, est  # the scenario needs a runner-up within 2x
    # the cheapest is measured (as predicted) at its size: the closest other one is tried
    hist = _history({(first.path, first.band): [1.0] * MIN_SAMPLES})
    second = LINK.choose(counts, height, row_bytes, world, True, history=hist, explore=2.0)
    assert second.explored and second.path == min(close, key=est.get)
    # ... until it has MIN_SAMPLES ratios (here: as predicted) ...
    for n in range(MIN_SAMPLES):
        again = LINK.choose(counts, height, row_bytes, world, True, history=hist, explore=2.0)
        assert again.explored and again.path == second.path, n
        hist.add((second.path, second.band), 1.0)
    third = LINK.choose(counts, height, row_bytes, world, True, history=hist, explore=2.0)
    left = [k for k in close if k != second.path]
    assert third.explored == bool(left)
    for k in left:
        band = size_band(LINK.estimates(counts, height, row_bytes, world, True)[k][1])
        for _ in range(MIN_SAMPLES):
            hist.add((k, band), 1.0)
    last = LINK.choose(counts, height, row_bytes, world, True, history=hist, explore=2.0)
    assert not last.explored and last.path == min(last.estimates_s, key=last.estimates_s.get)
    assert not LINK.choose(counts, height, row_bytes, world, True, history=_history({
        (first.path, first.band): [1.0] * MIN_SAMPLES}), explore=0.0).explored


def test_a_path_left_on_slow_measurements_is_measured_again_after_a_while():
    # broadcast measured 3x slower than predicted (the machine was busy then): allgather is
    # held. Were the factor never refreshed, broadcast would stay out however fast it has
    # become; after REMEASURE_STEPS steps without a measurement it counts as unmeasured
    # again (its old ratios forgotten), is tried, and wins on its new ratios
    counts, height, row_bytes, world = [4_000, 2_000, 2_000, 2_000], 1_000_000, 256, 4
    raw = LINK.estimates(counts, height, row_bytes, world, True)
    band = {k: size_band(v[1]) for k, v in raw.items()}
    assert raw["broadcast"][0] < raw["allgather"][0] < 2.0 * raw["broadcast"][0]  # scenario
    hist = _history({("broadcast", band["broadcast"]): [3.0] * MIN_SAMPLES})

    def step(path: str | None = None) -> PathChoice:
        choice = LINK.choose(counts, height, row_bytes, world, True, history=hist,
                             explore=2.0, current=path)
        hist.add((choice.path, band[choice.path]), 1.0)  # every path now runs as predicted
        hist.tick()
        return choice

    held = None
    for n in range(REMEASURE_STEPS):
        choice = step(held)
        held = choice.path if not choice.explored else held
        assert choice.path == "allgather" or (choice.path == "dense" and choice.explored), n
    tried = [step(held) for _ in range(MIN_SAMPLES + 2)]
    assert [c.path for c in tried] == ["broadcast"] * len(tried)
    assert hist.factor("broadcast", band["broadcast"]) == 1.0 and not tried[-1].explored
    # a path re-measured and still slower waits twice as long before the next try
    again = _history({("broadcast", band["broadcast"]): [3.0] * MIN_SAMPLES})
    for _ in range(REMEASURE_STEPS + 1):
        again.add(("allgather", band["allgather"]), 1.0)
        again.tick()
    assert not again.measured("broadcast", band["broadcast"])
    for _ in range(MIN_SAMPLES):
        again.add(("broadcast", band["broadcast"]), 3.0)
    for _ in range(2 * REMEASURE_STEPS):
        assert again.measured("broadcast", band["broadcast"])
        again.tick()
    assert not again.measured("broadcast", band["broadcast"])


def test_rows_sent_with_the_counts_are_padded_by_the_measured_growth():
    # a table whose largest count held still over the window is padded by 16 rows, not
    # 10 %: every padded row crosses the link from every rank
    sync = SparseGradSync(None, 2, path="allgather", link=LINK)
    emb = nn.Embedding(5000, 4, sparse=True)
    sync._seen[id(emb.weight)] = ((1000, 990), True, 16, 5000, (4,), torch.float32)
    assert sync._ahead([emb.weight])[1] == 1000 + 100  # too few steps seen: 10 %
    sync._growth[id(emb.weight)] = collections.deque([0.0] * 8, maxlen=8)
    assert sync._ahead([emb.weight])[1] == 1000 + 16
    sync._growth[id(emb.weight)].append(0.03)  # it grew 3 % once in the window
    assert sync._ahead([emb.weight])[1] == 1000 + 30
    # never above 10 %: a density that jumped 10x is one re-exchange, not 8 steps of 10x
    # padding (the carried all-gather then measured 3x slow and auto left it for good)
    sync._growth[id(emb.weight)].append(9.0)
    assert sync._ahead([emb.weight])[1] == 1000 + 100


def test_carried_rows_are_timed_until_the_slowest_rank_has_merged():
    # rows carried with the counts: the collective's own time is the last arrival's (the
    # shortest), the merge after it the slowest rank's; two ranks sharing a core merge
    # one after the other, so taking the fastest rank's whole time (6 ms) under-measured
    # the path and kept it held where another was faster
    sync = SparseGradSync(None, 2, path="auto", link=LINK)
    sync._carried = (("allgather", 3), 0.010, 0.0, 0.0)
    times_us = torch.tensor([[5000, 1000], [2000, 6000]])
    assert sync._carried_ratio(times_us) == pytest.approx(0.8)


def test_one_stalled_step_does_not_hold_a_slower_path():
    # a rank that waited for a core made one step of the held path 6x slower: its factor
    # (the median) is unmoved, and so is its noise, so a path 30 % cheaper is taken
    hist = _history({("allgather", 3): [1.0, 1.02, 0.98, 6.0, 1.0],
                     ("broadcast", 3): [0.7, 0.71, 0.69]})
    assert hist.noise("allgather", 3) < 0.02 and hist.factor("allgather", 3) == 1.0
    est = {p: hist.factor(p, 3) for p in ("allgather", "broadcast")}
    noise = {p: hist.noise(p, 3) for p in ("allgather", "broadcast")}
    assert sticky_path(est, noise, "allgather") == "broadcast"


def test_sticky_choice_keeps_a_path_within_noise_and_leaves_it_beyond():
    # the pure rule, with literal estimates and noise
    assert sticky_path({"a": 1.0, "b": 0.95}, {"a": 0.05, "b": 0.05}, "a") == "a"
    assert sticky_path({"a": 1.0, "b": 0.95}, {"a": 0.0, "b": 0.0}, "a") == "b"
    assert sticky_path({"a": 1.0, "b": 0.8}, {"a": 0.05, "b": 0.05}, "a") == "b"
    assert sticky_path({"a": 1.0, "b": 0.8}, {"a": 0.05, "b": 0.05}, None) == "b"
    assert sticky_path({"a": 1.0, "b": 1.2}, {"a": 0.5, "b": 0.5}, "b") == "b"
    # through the sync, with injected measured / predicted ratios (no timing): every path
    # measured at this size, allgather held; broadcast's estimate then drops below it
    counts, height, row_bytes, world = [2_000] * 4, 100_000, 256, 4
    est = LINK.estimates(counts, height, row_bytes, world, True)
    band = {k: size_band(v[1]) for k, v in est.items()}
    base = {k: v[0] for k, v in est.items()}
    # scale so that, corrected, allgather = 1.00 and broadcast = 0.96 of it: 4 % apart
    noisy = {"allgather": [0.9, 1.0, 1.1], "broadcast": [0.864, 0.96, 1.056],
             "dense": [10.0] * 3}
    samples = {(k, band[k]): [r * base["allgather"] / base[k] for r in v]
               for k, v in noisy.items()}
    sync = SparseGradSync(None, world, path="auto", link=LINK, explore=2.0)
    sync.history = _history(samples)
    emb = nn.Embedding(height, 4)
    sync._sticky[id(emb.weight)] = ("allgather", sum(counts))
    held = sync._choose(emb.weight, LINK, counts, height, row_bytes, True)
    assert held.estimates_s["broadcast"] < held.estimates_s["allgather"]  # cheaper ...
    assert held.path == "allgather" and not held.explored  # ... only by noise: kept
    assert held.noise["allgather"] == pytest.approx(MAD_TO_SE * 0.1 / 3 ** 0.5)
    # the same 4 % with quiet measurements is beyond the noise: it moves
    quiet = {k: [statistics.median(v)] * 3 for k, v in samples.items()}
    sync.history = _history(quiet)
    moved = sync._choose(emb.weight, LINK, counts, height, row_bytes, True)
    assert moved.path == "broadcast" and not moved.explored
    assert sync._sticky[id(emb.weight)] == ("broadcast", sum(counts))
    # rows within MOVE x of where broadcast was chosen: nothing is re-measured
    near = [int(c * 1.5) for c in counts]
    assert not density_moved(sum(near), sum(counts))
    sync._choose(emb.weight, LINK, near, height, row_bytes, True)
    assert all(sync.history.measured(*k) for k in quiet)
    # the density moves (x4): the paths at the new size count as unmeasured again, the
    # sticky path is dropped and the cheapest is taken afresh (then measured, then others)
    far = [c * 4 for c in counts]
    assert density_moved(sum(far), sum(counts))
    est_far = LINK.estimates(far, height, row_bytes, world, True)
    stale = {(k, size_band(v[1])) for k, v in est_far.items()}
    for k in stale:
        sync.history.add(k, 1.0)  # measured there before (as if at an earlier density)
        sync.history.add(k, 1.0)
        sync.history.add(k, 1.0)
    again = sync._choose(emb.weight, LINK, far, height, row_bytes, True)
    assert not any(sync.history.measured(*k) for k in stale)
    assert not again.explored and again.path == min(again.estimates_s,
                                                     key=again.estimates_s.get)
    assert sync._sticky[id(emb.weight)] == (again.path, sum(far))


def test_sparse_config_keys_are_validated(tmp_path):
    cfg = load_config(None, ["sync.sparse=true", "sync.sparse_path=broadcast"])
    assert cfg.sync.sparse and cfg.sync.sparse_path == "broadcast"
    with pytest.raises(ConfigError, match="sync.sparse_path"):
        load_config(None, ["sync.sparse_path=ring"])
    with pytest.raises(ConfigError, match="sync.sparse_bandwidth"):
        load_config(None, ["sync.sparse_bandwidth=-1"])
    with pytest.raises(ConfigError, match="sync.sparse_explore"):
        load_config(None, ["sync.sparse_explore=-0.5"])
    with pytest.raises(ConfigError, match="sync.strategy"):
        load_config(None, ["sync.sparse=true", "sync.strategy=tokenring"])


@pytest.mark.timeout(180)
def test_bench_sparse_runs_at_tiny_size():
    from trainwright.bench import BENCHMARKS
    from trainwright.bench.sparse import SparseBenchSpec, rule_held, run, summarise
    from trainwright.bench.sparse_rank import SYSTEMS, step_s, steps_for

    assert BENCHMARKS["sparse"] == "trainwright.bench.sparse"
    spec = SparseBenchSpec(rows=2000, dim=8, world=2, densities=[0.01, 0.5], repeats=2, steps=2,
                           round_s=0.0)
    result = run(spec, timeout_s=160)  # the ranks assert that all systems' gradients agree
    rows = result["rows"]
    assert {(r["system"], r["density"]) for r in rows} == {
        (s, d) for s in SYSTEMS for d in (0.01, 0.5)}
    for r in rows:
        assert len(r["sync_s_rounds"]) == 2 and r["sync_s"] == statistics.median(r["sync_s_rounds"])
        assert r["steps_per_round"] == 2  # round_s = 0: the fewest steps
    # a round's steps are sized from the pilot's steps (fb + sync; DDP: both backwards)
    pilot = {"fb": [0.004, 0.006, 0.1], "sync": [0.004] * 3, "nosync_fb": []}
    ddp = {"fb": [0.02] * 3, "sync": [], "nosync_fb": [0.01] * 3}
    slot = step_s(pilot) + step_s(ddp)
    assert slot == pytest.approx(0.04)
    assert steps_for(SparseBenchSpec(round_s=4.0), slot) == 100
    assert steps_for(SparseBenchSpec(round_s=4.0, max_steps=50), slot) == 50
    assert steps_for(SparseBenchSpec(round_s=0.01, steps=15), slot) == 15
    at = {(r["system"], r["density"]): r for r in rows}
    # every forced path at every density, beside auto, from the rows
    assert result["paths"]["0.5"]["broadcast"] == round(at["forced_broadcast", 0.5]["sync_s"], 6)
    assert set(result["paths"]["0.01"]) == {"allgather", "broadcast", "dense", "auto", "auto_took"}
    assert sum(at["trainwright", 0.01]["path_counts"].values()) == 2 * 2
    # the headline: paired per-round ratios of auto against DDP at 1 %
    ours, ddp = at["trainwright", 0.01]["sync_s_rounds"], at["ddp_sparse", 0.01]["sync_s_rounds"]
    want = [a / max(b, 1e-9) for a, b in zip(ours, ddp, strict=True)]
    assert result["paired_ratios"] == [round(x, 4) for x in want]
    assert result["ratio_vs_ddp_sparse_at_1pct"] == round(statistics.median(want), 4)
    assert result["ratio_vs_ddp_sparse_at_1pct_spread"] == result["ratio_spread"]
    best = [min(at[f"forced_{p}", 0.5]["sync_s_rounds"][i] for p in ("allgather", "broadcast",
                                                                     "dense")) for i in range(2)]
    auto_hi = at["trainwright", 0.5]["sync_s_rounds"]
    assert result["auto_vs_best_forced"]["0.5"]["ratio"] == round(
        statistics.median([a / b for a, b in zip(auto_hi, best, strict=True)]), 4)
    assert result["auto_vs_best_forced_max"] == max(
        v["ratio"] for v in result["auto_vs_best_forced"].values())
    assert summarise(rows, spec)["ratio"] == result["ratio"]
    assert result["host"]["cpus"] >= 1 and result["host"]["torch"] == torch.__version__
    # the sticky rule, recomputed from what every step recorded; and a step that broke it
    assert result["auto_followed_sticky_rule"]
    taken = at["trainwright", 0.5]["paths_taken"]
    assert taken and all({"estimates_s", "noise", "held"} <= set(t) for t in taken)
    bad = dict(path="dense", explored=False, held="dense",
               estimates_s={"allgather": 1.0, "broadcast": 2.0, "dense": 1.5},
               noise={"allgather": 0.05, "broadcast": 0.0, "dense": 0.05})
    assert not rule_held([*taken, bad])  # held dense, but allgather is cheaper beyond noise
    assert rule_held([*taken, dict(bad, estimates_s={**bad["estimates_s"], "dense": 1.04})])
    assert not rule_held([dict(bad, held="allgather")])  # neither the cheapest nor held
    # the new key and a judged block (median, 90 % interval, verdict) for every target
    plain = at["dense_allreduce", 0.5]["sync_s_rounds"]
    assert result["ratio_vs_dense_allreduce"]["0.5"]["paired_ratios"] == [
        round(a / b, 4) for a, b in zip(auto_hi, plain, strict=True)]
    judged = result["judged"]
    for name in ("auto_vs_best_forced_max", "ratio_vs_dense_allreduce", "ratio_vs_dense_step"):
        blocks = judged[name]["per_density"]
        assert set(blocks) == {"0.01", "0.5"}, name
        for block in blocks.values():
            assert block["target_is"] == "at_most" and block["verdict"] in ("met", "missed")
            lo, hi = block["interval"]
            assert lo <= block["median"] <= hi
            assert block["verdict"] == ("met" if hi <= block["target"] else "missed")
        assert judged[name]["verdict"] == ("met" if all(
            b["verdict"] == "met" for b in blocks.values()) else "missed")
        assert result["targets_met"][name] == (judged[name]["verdict"] == "met")
    assert judged["ratio_vs_dense_allreduce"]["per_density"]["0.01"]["target"] == 0.2
    assert judged["ratio_vs_dense_allreduce"]["per_density"]["0.5"]["target"] == 1.05
    assert judged["ratio_vs_ddp_sparse_at_1pct"]["target"] == 0.65
    assert judged["ratio_vs_ddp_sparse_at_1pct"]["interval"] == result["interval"]
    assert at["dense_allreduce", 0.01]["bytes_sent_per_rank"] == 2 * 1 / 2 * 2000 * 8 * 4


def test_learned_factors_follow_the_slowest_rank_and_bad_input_is_named():
    sync = SparseGradSync(None, 4, path="auto", link=LINK)
    est = LINK.estimates([100] * 4, 1000, 256, 4, True)
    band = size_band(est["allgather"][1])
    # gathered ratios x1000 per rank for last step's (path, band) pairs
    keys = [("allgather", band), ("dense", 30)]
    sync._learn(keys, torch.tensor([[3000, 0], [2000, 0], [4000, 0], [1000, 0]]))
    assert sync.factors == {("allgather", band): pytest.approx(4.0)}  # first: the slowest
    sync._learn(keys[:1], torch.tensor([[2000], [1000], [1000], [1000]]))
    assert sync.factors == {("allgather", band): pytest.approx(3.0)}  # then averaged in
    # fewer than MIN_SAMPLES ratios: a slower verdict is not trusted yet (a path's first
    # transfer at a size is cold), so the estimate stays the model's and the path is tried
    scaled = LINK.choose([100] * 4, 1000, 256, 4, True, history=sync.history).estimates_s
    assert scaled["allgather"] == pytest.approx(est["allgather"][0])
    sync._learn(keys[:1], torch.tensor([[2000], [1000], [1000], [1000]]))  # 4, 2, 2
    scaled = LINK.choose([100] * 4, 1000, 256, 4, True, history=sync.history).estimates_s
    assert scaled["allgather"] == pytest.approx(2.0 * est["allgather"][0])
    assert scaled["dense"] == pytest.approx(est["dense"][0])
    # a band never measured borrows a neighbouring band's factor of the same path, if any
    near = LINK.choose([400] * 4, 10**6, 256, 4, True, history=sync.history)
    assert size_band(near.bytes_sent_per_rank) == band + 1 and near.factors["allgather"] == 2.0
    # a faster first verdict is taken at once (measuring more cannot make it cheaper to
    # try), a slower one only once measured
    h = CostHistory()
    h.add(("broadcast", 3), 0.5)
    h.add(("allgather", 3), 4.9)
    assert h.factor("broadcast", 3) == 0.5 and h.factor("allgather", 3) == 1.0
    for _ in range(MIN_SAMPLES - 1):
        h.add(("allgather", 3), 4.9)
    assert h.factor("allgather", 3) == pytest.approx(4.9)
    far = LINK.choose([100_000] * 4, 10**6, 256, 4, True, history=sync.history)
    assert size_band(far.bytes_sent_per_rank) > band + 1 and far.factors["allgather"] == 1.0
    for _ in range(3):  # ratios 4, 2, 2, 2, 2 then a step slowed by something else
        sync._learn(keys[:1], torch.tensor([[2000], [1000], [1000], [1000]]))
    assert sync.factors == {("allgather", band): pytest.approx(2.0)}
    sync._learn(keys[:1], torch.tensor([[50000], [1000], [1000], [1000]]))
    assert sync.factors == {("allgather", band): pytest.approx(2.0)}  # median of the last 5
    with pytest.raises(ValueError, match="explore"):
        SparseGradSync(None, 2, explore=-1)
    with pytest.raises(ValueError, match="sparse path 'ring'"):
        SparseGradSync(None, 2, path="ring")
    with pytest.raises(TypeError, match="floating-point"):
        from trainwright.sync.rowsparse import _pack

        _pack(RowSparse(torch.tensor([0]), 2, torch.tensor([[1]])), 1)
    with pytest.raises(TypeError, match="one sparse dimension"):
        RowSparse.from_coo(torch.ones(2, 2))
