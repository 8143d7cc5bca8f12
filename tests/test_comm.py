"""Transfers fail loudly instead of hanging; bucketed all-reduce equals the naive one."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import FakeClock
from trainwright.dist.comm import P2P, Watchdog, pack_header, unpack_header
from trainwright.dist.testing import run_workers
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


def _deadline(rank, world, signal_dir):
    """Rank 0 stays alive and silent until rank 1's receive has given up, so only a deadline
    ends that receive: P2P's 1 s one, well inside the bound (the group's own 60 s time-out,
    run_workers', would not be)."""
    p2p = P2P(dist.group.WORLD, rank, timeout_s=1.0, device=torch.device("cpu"))
    gave_up = Path(signal_dir, "rank1_gave_up")
    if rank == 1:
        t0 = time.monotonic()
        with pytest.raises(CommError, match="act header with rank 0 failed: .*Timed out"):
            p2p.recv(0, "act", 0)
        assert time.monotonic() - t0 < 30
        gave_up.touch()
    else:  # alive but silent past the deadline (a timed-out gloo pair is unusable after)
        deadline = time.monotonic() + 90
        while not gave_up.exists():
            assert time.monotonic() < deadline, "rank 1's receive never timed out"
            time.sleep(0.05)


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


@pytest.mark.timeout(300)  # five groups of two spawned ranks: ~40 s on 2 shared cores
def test_p2p_checks_and_deadlines(tmp_path):
    run_workers(_round_trip, 2)
    run_workers(_mismatch, 2)
    run_workers(_deadline, 2, str(tmp_path))
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


@pytest.mark.timeout(180)
def test_bucketed_all_reduce_equals_naive():
    run_workers(_dense, 4)


def _dogs(n: int, timeout_s: float, clock: FakeClock):
    """``n`` watchdogs on one in-process store, driven by the test (no thread): each one's
    first verdict lands in ``verdicts[rank]``."""
    store = dist.HashStore()
    verdicts: dict[int, tuple[int, str]] = {}
    dogs = [Watchdog(lambda: store, r, n, timeout_s,
                     lambda lost, why, me=r: verdicts.setdefault(me, (lost, why)), clock=clock)
            for r in range(n)]
    return store, dogs, verdicts


def _beat_at(clock: FakeClock, t: float, store, dogs) -> None:
    clock.now = t
    for d in dogs:
        d.beat(store)


@pytest.mark.timeout(30)
def test_watchdog_names_the_silent_rank():
    clock = FakeClock()
    store, dogs, verdicts = _dogs(3, 0.5, clock)
    for t in (0.0, 0.125, 0.25):
        _beat_at(clock, t, store, dogs)
    # rank 2 goes silent without saying it is done; it beat after ranks 0 and 1 at 0.25, so
    # they see that beat at 0.375
    for t in (0.375, 0.625, 0.875):  # unchanged for 0.5 s at most: not lost yet
        _beat_at(clock, t, store, dogs[:2])
    assert verdicts == {}
    _beat_at(clock, 1.0, store, dogs[:2])
    assert verdicts == {0: (2, verdicts[0][1]), 1: (2, verdicts[1][1])}
    for r in (0, 1):
        assert verdicts[r][1].startswith("no heartbeat for 0.6 s"), verdicts[r]


@pytest.mark.timeout(30)
def test_watchdog_ignores_finished_ranks_and_reports_failures():
    clock = FakeClock()
    store, dogs, verdicts = _dogs(3, 0.5, clock)
    _beat_at(clock, 0.0, store, dogs)
    dogs[1].stop()  # finished cleanly: nobody complains, however long it stays silent
    for t in (1.0, 2.0, 60.0):
        _beat_at(clock, t, store, [dogs[0], dogs[2]])
    assert verdicts == {}
    dogs[2].stop(failed="ValueError: bad shape")
    assert not dogs[0].beat(store)
    assert verdicts == {0: (2, "it failed: ValueError: bad shape")}


@pytest.mark.timeout(60)
def test_watchdog_names_a_rank_that_dies_before_its_first_period():
    """A rank killed within its first heartbeat period (a fast set-up, an early fault step)
    has still beaten once, so the others declare it lost instead of waiting forever."""
    clock = FakeClock()
    store, (watcher, doomed), verdicts = _dogs(2, 2.5, clock)
    watcher.beat(store)  # sees rank 1 at 0 beats: not started yet, never declared so
    doomed.start()
    doomed._stop.set()  # stopped (silent) before its first period of 0.5 s ends
    doomed._thread.join(30)
    assert not doomed._thread.is_alive()
    for t in (1.0, 3.5):  # the watcher sees its one beat at 1.0; 2.5 s later: not yet
        _beat_at(clock, t, store, [watcher])
    assert verdicts == {}
    _beat_at(clock, 3.75, store, [watcher])
    assert verdicts[0][0] == 1 and "no heartbeat" in verdicts[0][1], \
        "rank 1 died before its first period and was never declared lost"


@pytest.mark.timeout(60)
def test_watchdog_thread_declares_a_silent_rank_over_a_tcp_store():
    """The heartbeat thread, on the real clock and the store clients workers use."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = server.port
    client = lambda: dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # noqa: E731
    dogs = [Watchdog(client, r, 2, 0.5, lambda r, why: None).start() for r in range(2)]
    dogs[1]._stop.set()  # silent from now on, without saying it is done
    verdict = dogs[0].verdict(30)  # 0.5 s idle; the deadline is for a loaded machine
    assert verdict is not None and verdict[0] == 1 and "no heartbeat" in verdict[1], verdict
    dogs[0].stop()
    del server


def test_a_free_port_lies_outside_the_range_the_kernel_hands_out():
    # a port the kernel hands out on bind(0) or as a connection's source port can be taken
    # between free_port() and the rendezvous's bind (CI: 'Address already in use')
    from trainwright.dist.ports import ephemeral_range, free_port

    lo, hi = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
