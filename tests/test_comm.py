"""Transfers fail loudly instead of hanging; bucketed all-reduce equals the naive one."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from trainwright.dist.comm import P2P, Watchdog, pack_header, unpack_header
from trainwright.dist.testing import free_port, run_workers
from trainwright.errors import CommError
from trainwright.sync.dense import BucketedAllReduce, naive_all_reduce


def test_header_round_trip():
    ts = [torch.zeros(2, 3, 4), None, torch.ones(5, dtype=torch.int64).requires_grad_(False)]
    ts[0].requires_grad_()
    kind, mb, metas, ahead = unpack_header(pack_header("grad", 7, ts, ahead=2))
    assert (kind, mb, ahead) == (2, 7, 2)
    assert metas == [(torch.float32, True, (2, 3, 4)), None, (torch.int64, False, (5,))]


def _mismatch(rank, world):
    p2p = P2P(dist.group.WORLD, rank, timeout_s=20, device=torch.device("cpu"))
    if rank == 0:  # gloo completes a send only when it is received: do not wait for it
        p2p.send(1, "act", 1, [torch.ones(3)])
    else:
        with pytest.raises(CommError, match="expected act of micro-batch 0 from rank 0 but "
                                            "received act of micro-batch 1"):
            p2p.recv(0, "act", 0)
    dist.barrier()


def _deadline(rank, world):
    p2p = P2P(dist.group.WORLD, rank, timeout_s=1.0, device=torch.device("cpu"))
    if rank == 1:
        t0 = time.monotonic()
        with pytest.raises(CommError, match="act header with rank 0 failed: .*Timed out"):
            p2p.recv(0, "act", 0)
        assert time.monotonic() - t0 < 2.5
    else:  # alive but silent past the deadline (a timed-out gloo pair is unusable after)
        time.sleep(3)


def _round_trip(rank, world):
    p2p = P2P(dist.group.WORLD, rank, timeout_s=20, device=torch.device("cpu"))
    x = torch.arange(12.0).view(3, 4)
    if rank == 0:
        p2p.send(1, "act", 0, [x, torch.tensor([1, 2])])
        (g,) = p2p.recv(1, "grad", 0)
        torch.testing.assert_close(g, 2 * x)
    else:
        a, b = p2p.recv(0, "act", 0)
        torch.testing.assert_close(a, x)
        assert b.dtype == torch.int64 and b.tolist() == [1, 2]
        p2p.send(0, "grad", 0, [2 * a])
    p2p.wait_sends()


def _posted_ahead(rank, world):
    p2p = P2P(dist.group.WORLD, rank, timeout_s=20, device=torch.device("cpu"))
    # message 1 lands in the receives posted ahead; message 2's shapes differ from what was
    # posted (placeholders travel first); a None travels as a placeholder only
    msgs = [[(3, 4), None], [(3, 4), None], [None, (2, 5)], [(1,), (2, 2)]]
    if rank == 0:
        for mb, shapes in enumerate(msgs):
            p2p.send(1, "act", mb, [None if s is None else torch.full(s, float(mb))
                                    for s in shapes], tag=3, ahead=mb > 0)
        p2p.wait_sends()
        assert len(p2p._pending) == 0
    else:
        for mb, shapes in enumerate(msgs):
            got = p2p.recv(0, "act", mb, tag=3, more=mb < len(msgs) - 1)
            assert [None if t is None else tuple(t.shape) for t in got] == shapes
            for t in got:
                if t is not None:
                    torch.testing.assert_close(t, torch.full(t.shape, float(mb)))
            early = p2p._early.get((0, 3))
            assert (early is not None) == (mb < len(msgs) - 1)
            if early is not None:  # the payload receive, shaped like this message
                assert [tuple(t.shape) for _, t in early[2]] == [s for s in shapes if s]
    dist.barrier()


def _ahead_disagreement(rank, world):
    p2p = P2P(dist.group.WORLD, rank, timeout_s=20, device=torch.device("cpu"))
    if rank == 0:  # the sender does not know that the second receive was posted ahead
        for mb in range(2):
            p2p.send(1, "grad", mb, [torch.ones(3)], tag=5)
        p2p.wait_sends()
    else:
        p2p.recv(0, "grad", 0, tag=5, more=True)
        with pytest.raises(CommError, match="disagree on the receives posted ahead"):
            p2p.recv(0, "grad", 1, tag=5)
        p2p._early.clear()
    dist.barrier()


@pytest.mark.timeout(90)
def test_p2p_checks_and_deadlines():
    run_workers(_round_trip, 2)
    run_workers(_mismatch, 2)
    run_workers(_deadline, 2)
    run_workers(_posted_ahead, 2)
    run_workers(_ahead_disagreement, 2)


def _dense(rank, world):
    torch.manual_seed(rank)
    shapes = [(7, 3), (5,), (64, 8), (1,), (3, 3), (40, 8)]
    a = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    b = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        if i != 3:  # one parameter without a gradient on every rank
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
    # two bucket-sized gradients, alone in their buckets: one reduced in place, one (not
    # contiguous) through a flat copy
    a[2].grad = a[2].grad.t().contiguous().t()
    assert not a[2].grad.is_contiguous() and a[5].grad.is_contiguous()
    sync = BucketedAllReduce(dist.group.WORLD, world, bucket_bytes=256)
    assert len(sync.buckets(a)) > 2
    sync.sync(a)
    naive_all_reduce(b, dist.group.WORLD, world)
    expected = []  # the mean of every rank's gradient, rebuilt from the seeds
    for i, s in enumerate(shapes):
        grads = []
        for r in range(world):
            torch.manual_seed(r)
            draws = [torch.randn(shapes[j]) for j in range(len(shapes)) if j != 3]
            grads.append(torch.zeros(s) if i == 3 else draws[i if i < 3 else i - 1])
        expected.append(sum(grads) / world)
    for p, q, e in zip(a, b, expected, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p.grad, e)


@pytest.mark.timeout(90)
def test_bucketed_all_reduce_equals_naive():
    run_workers(_dense, 4)


@pytest.mark.timeout(30)
def test_watchdog_names_the_silent_rank():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", port, 3, is_master=False,
                             timeout=datetime.timedelta(seconds=5))

    verdicts: dict[int, tuple] = {}
    found = threading.Event()

    def on_lost(me):
        def record(rank, reason):
            verdicts[me] = (rank, reason)
            found.set()
        return record

    dogs = [Watchdog(client, r, 3, 0.5, on_lost(r)).start() for r in range(3)]
    time.sleep(0.5)
    dogs[2]._stop.set()  # rank 2 goes silent without saying it is done
    assert found.wait(10)
    time.sleep(0.5)
    for r in (0, 1):
        assert verdicts[r][0] == 2 and "no heartbeat" in verdicts[r][1]
    for d in dogs:
        d.stop()
    del server


@pytest.mark.timeout(30)
def test_watchdog_ignores_finished_ranks_and_reports_failures():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", port, 3, is_master=False)  # noqa: E731
    seen: list = []
    dogs = [Watchdog(client, r, 3, 0.5, lambda r, why: seen.append((r, why))).start()
            for r in range(3)]
    time.sleep(0.4)
    dogs[1].stop()  # finished cleanly: nobody complains
    time.sleep(1.5)
    assert seen == []
    dogs[2].stop(failed="ValueError: bad shape")
    time.sleep(0.5)
    assert seen and seen[0][0] == 2 and "bad shape" in seen[0][1]
    dogs[0].stop()
    del server


@pytest.mark.timeout(30)
def test_watchdog_names_a_rank_that_dies_before_its_first_period():
    """A rank killed within its first heartbeat period (a fast set-up, an early fault step)
    has still beaten once, so the others declare it lost instead of waiting forever."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # noqa: E731
    seen: list = []
    found = threading.Event()
    watcher = Watchdog(client, 0, 2, 2.5, lambda r, why: (seen.append((r, why)), found.set()))
    doomed = Watchdog(client, 1, 2, 2.5, lambda r, why: None).start()  # period: 0.5 s
    watcher.start()
    time.sleep(0.2)
    doomed._stop.set()  # silent from now on, without saying it is done
    assert found.wait(8), "rank 1 died before its first period and was never declared lost"
    assert seen[0][0] == 1 and "no heartbeat" in seen[0][1]
    watcher.stop()
    del server
