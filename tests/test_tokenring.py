"""Token ring: wire format, ring arithmetic, and 4-node runs on 127.0.0.1.

The multi-node tests start real node processes (pyzmq, no process group) through
:func:`launch_ring` with short time-outs; each checks replicas against each other by
parameter hash at every step, and the no-fault run against single-process SGD.
"""

from __future__ import annotations

import json
import time
from unittest import mock

import pytest
import torch
import zmq
from torch import nn

from tests.helpers import FakeClock, assert_identical_replicas, ring_cfg, run_ring
from trainwright.errors import CommError, ConfigError
from trainwright.model.build import build_data, build_layers, loss_fn
from trainwright.run.ring_node import param_hash
from trainwright.tokenring.membership import Epoch, announce_delay, ring_distance
from trainwright.tokenring.ring import contributors_needed, sum_canonical
from trainwright.tokenring.token import token_header
from trainwright.tokenring.wire import pack, unpack


# ---------------------------------------------------------------- no processes
@pytest.mark.timeout(30)
def test_frames_round_trip_raw_tensors():
    ts = [torch.randn(3, 4), torch.arange(5, dtype=torch.int64), torch.empty(0, 2),
          torch.randn(2, 3).t()]  # non-contiguous is made contiguous
    frames = pack({"t": "grad", "step": 7}, ts)
    assert len(frames) == 1 + len(ts) and frames[1].nbytes == 3 * 4 * 4
    header, back = unpack([zmq.Frame(bytes(f)) for f in frames])
    assert header["step"] == 7
    for a, b in zip(ts, back, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(30)
def test_push_pull_with_unlimited_hwm_loses_nothing_sent_before_the_peer_binds():
    ctx = zmq.Context()
    try:
        port = ctx.socket(zmq.PULL).bind_to_random_port("tcp://127.0.0.1")  # find a port
        ctx.destroy(0)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        n = 20000  # far above the default high-water mark of 1000
        for i in range(n):
            push.send(i.to_bytes(4, "little"))
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.bind(f"tcp://127.0.0.1:{port}")
        got = []
        while len(got) < n and pull.poll(5000):
            got.append(int.from_bytes(pull.recv(), "little"))
        assert got == list(range(n))
    finally:
        ctx.destroy(0)


@pytest.mark.timeout(30)
def test_ring_arithmetic():
    assert contributors_needed(0.9, 4) == 4  # the default 0.9 needs all four of four
    assert contributors_needed(0.75, 4) == 3
    assert contributors_needed(0.75, 3) == 3
    assert contributors_needed(0.5, 3) == 2
    ep = Epoch((0, 0), {0: "a", 1: "b", 3: "d"})
    assert ep.successor(0) == 1 and ep.successor(1) == 3 and ep.successor(3) == 0
    assert ep.successor(2) == 3  # a lost node's successor
    assert ep.predecessor(0) == 3 and ep.predecessor(3) == 1 and ep.predecessor(2) == 1
    assert ring_distance(ep.order, 1, 3) == 1 and ring_distance(ep.order, 1, 0) == 2
    assert ring_distance(ep.order, 2, 0) == 2  # from a dropped node
    assert ep.without(1, 3).key == (1, 3) and ep.without(1, 3).order == [0, 3]
    assert announce_delay(1, 0.5, 0.3) < announce_delay(2, 0.5, 0.3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n,chunks", [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (5, 2),
                                      (8, 3), (8, 4)])
def test_the_sums_routes_reach_every_other_member_once(n, chunks):
    """Walked as ``_on_chunk`` forwards: each route from its first member the way it goes,
    until its last member; both ways round (half the hops) for a sum of at most
    floor((n - 1) / 2) chunks."""
    from trainwright.tokenring.sumpass import pass_routes

    ep = Epoch((0, 0), {i: str(i) for i in range(0, 2 * n, 2)})  # indices 0, 2, 4, ...
    both = chunks <= (n - 1) // 2
    for closer in ep.order:
        reached = []
        routes = pass_routes(ep.order, closer, chunks)
        assert len(routes) == (2 if both and n > 2 else min(1, n - 1))
        for first, way, last in routes:
            node, hops = first, 1
            while True:
                reached.append(node)
                if node == last:
                    break
                node = ep.successor(node) if way > 0 else ep.predecessor(node)
                hops += 1
            assert hops <= (-(-(n - 1) // 2) if both else n - 1)  # ceil((n - 1) / 2)
        assert sorted(reached) == [m for m in ep.order if m != closer]


@pytest.mark.timeout(30)
def test_sum_pass_chunks_cover_the_sum_and_a_rebuilt_sum_is_the_tokens_bit_for_bit():
    from trainwright.tokenring.sumpass import (
        SumAssembly,
        chunk_plan,
        chunk_tensors,
        fold,
        layout_of,
    )

    grads = {c: [torch.randn(37, 11) * 10 ** c, torch.randn(5), torch.empty(0)]
             for c in (2, 0, 3)}
    order = [2, 0, 3]  # the token's order
    hop = list(grads[2])  # as the token does it, hop by hop
    for c in order[1:]:
        hop = [a + g for a, g in zip(hop, grads[c], strict=True)]
    rebuilt = fold([grads[c] for c in order])
    assert all(torch.equal(a, b) for a, b in zip(hop, rebuilt, strict=True))
    layout = layout_of(hop)
    plan = chunk_plan(layout, chunk_bytes=64)  # 16 floats a chunk
    # (407 + 5) floats in 26 chunks: the small tensors share the last one with the large
    # one's end (each tensor in chunks of its own took 28)
    assert len(plan) == 26 and plan[0] == [(0, 0, 16)]
    assert plan[-1] == [(0, 400, 407), (1, 0, 5), (2, 0, 0)]
    assert chunk_plan([[[3], "float32"], [[4], "float32"]], chunk_bytes=8) == [
        [(0, 0, 2)], [(0, 2, 3), (1, 0, 1)], [(1, 1, 3)], [(1, 3, 4)]]
    asm = SumAssembly(layout, chunk_bytes=64)
    for k in reversed(range(len(plan))):  # any order, duplicates ignored
        assert asm.add(k, [t.clone() for t in chunk_tensors(hop, plan[k])])
        assert not asm.add(k, chunk_tensors(hop, plan[k]))
        assert asm.complete == (k == 0)
    assert all(torch.equal(a, b) for a, b in zip(asm.tensors, hop, strict=True))
    with pytest.raises(ValueError, match="disagree on the chunk plan"):
        SumAssembly(layout, chunk_bytes=64).add(0, [torch.zeros(3)])


@pytest.mark.timeout(30)
def test_canonical_sum_is_order_independent_bitwise():
    g = {i: [torch.randn(1000) * 10 ** i] for i in range(4)}
    a = sum_canonical(g)
    b = sum_canonical(dict(reversed(list(g.items()))))
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[0], sum(g[i][0] for i in range(4)))


@pytest.mark.timeout(30)
def test_tokenring_config_errors(tmp_path):
    ring_cfg(tmp_path, **{"train.optimizer": '"adamw"'})  # any torch.optim optimizer
    with pytest.raises(ConfigError, match="does not split into tokenring.nodes"):
        ring_cfg(tmp_path, **{"train.batch_size": 30})
    with pytest.raises(ConfigError, match="close_fraction"):
        ring_cfg(tmp_path, **{"tokenring.close_fraction": 1.5})
    with pytest.raises(ConfigError, match="node indices are 0..3"):
        ring_cfg(tmp_path, **{"tokenring.kill_nodes": [7]})
    with pytest.raises(ConfigError, match="min_nodes"):
        ring_cfg(tmp_path, **{"tokenring.min_nodes": 5})
    with pytest.raises(ConfigError, match="tokenring.close_grace_s = -1"):
        ring_cfg(tmp_path, **{"tokenring.close_grace_s": -1})
    with pytest.raises(ConfigError, match="tokenring.slow_probability = 1.5"):
        ring_cfg(tmp_path, **{"tokenring.slow_probability": 1.5})


def _stop_rings(ctx, *rings) -> None:
    """Close what in-process rings (threads never started) opened, then the context."""
    for ring in rings:
        ring.stop()
    ctx.term()


def _four_node_ring(close_grace_s: float):
    """Node 0 of a 4-node ring that never connects (its peers' addresses are unused), on a
    fake clock: ``(ctx, pull socket, clock, ring)``; the caller stops them
    (:func:`_stop_rings`)."""
    import zmq

    from trainwright.tokenring.ring import RingTimes, TokenRing

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    epoch = Epoch((0, 0), {i: f"tcp://127.0.0.1:{9000 + i}" for i in range(4)})
    clock = FakeClock(100.0)
    ring = TokenRing(ctx, 0, pull, epoch, close_fraction=0.5, min_nodes=2, total_steps=10,
                     times=RingTimes(close_grace_s=close_grace_s), clock=clock)
    return ctx, pull, clock, ring


@pytest.mark.timeout(30)
def test_close_rule_waits_a_grace_after_the_fraction_and_not_when_all_are_in():

    from trainwright.tokenring.ring import Token

    ctx, pull, clock, ring = _four_node_ring(close_grace_s=0.25)
    try:
        assert not ring._may_close(Token(1, [0], 0, 1))  # below the fraction: never
        clock.advance(60)
        assert not ring._may_close(Token(1, [0], 0, 1))
        assert ring._may_close(Token(2, [0, 1, 2, 3], 0, 1))  # everyone in: at once
        half = Token(3, [0, 2], 0, 1)
        assert not ring._may_close(half)  # the fraction is met: the grace starts now
        clock.advance(0.125)
        assert not ring._may_close(half)  # half the grace
        clock.advance(0.125)
        assert ring._may_close(half)  # ... and closes the step without the late nodes
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_a_message_wakes_the_trainer_only_when_it_changes_what_the_trainer_waits_on():
    """Woken at every message, each node's trainer thread took the interpreter and the lock
    from the receiver thread once per chunk of a pass (the pass to the last node measured
    ~2 ms faster without it). A readiness notice changes nothing a trainer waits on; a
    token notice that carries a new close does."""
    import threading

    from trainwright.tokenring.ring import Token

    class Counting(threading.Condition):
        woken = 0

        def notify_all(self):
            Counting.woken += 1
            super().notify_all()

    ctx, pull, clock, ring = _four_node_ring(close_grace_s=0.25)
    ring.cv = Counting()
    ring.tok = Token(1, [], 1, 3)

    def deliver(header: dict) -> None:
        ring._handle([zmq.Frame(bytes(f)) for f in pack(
            {**header, "src": 1, "inc": 7, "sq": deliver.sq}, [])])
        deliver.sq += 1
    deliver.sq = 1
    try:
        deliver({"t": "want", "step": 1})
        deliver({"t": "alive"})
        assert Counting.woken == 0
        deliver(token_header(Token(2, [], 2, 4), ring.epoch, {1: [0, 1, 2, 3]},
                             to_holder=False))
        assert ring.closes[1] == [0, 1, 2, 3] and Counting.woken == 1
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_a_member_that_has_not_heard_the_token_yet_says_its_gradient_is_ready():
    """A member learns the token's step from its first hop; the holder keeps an idle token
    (nobody said they are ready) for a quarter of ``token_timeout_s``. Waiting for the token
    before saying it was ready, every member's first step took that long: 0.5 s against
    0.2 s for the benchmark's later steps, 4 % of its time to target."""
    ctx, pull, clock, ring = _four_node_ring(close_grace_s=0.25)
    said = []
    ring._broadcast = lambda header, tensors=(): said.append(header)
    try:
        assert ring.tok is None and ring.applied == 0
        ring.offer(1, [torch.ones(3)])
        ring._serve()
        assert {"t": "want", "step": 1} in said
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_a_dropped_sums_tensors_take_the_place_of_fresh_ones_and_a_fetch_answer_is_a_copy():
    """A sum written into memory fresh from the allocator faulted its pages in chunk by
    chunk on the pass's critical path (0.9 ms of CPU for a 256 KiB chunk at the 90th
    percentile on the benchmark host): the tensors of a sum this node assembled go back
    to its buffers when the sum is dropped, ``RETAIN_STEPS`` after it was applied, and the
    next sum it assembles is written into them. A fetch's answer, which may wait in a
    queue that long, is sent as a copy."""
    from trainwright.tokenring.ring import RETAIN_STEPS
    from trainwright.tokenring.sumpass import chunk_plan, chunk_tensors, layout_of

    ctx, pull, clock, ring = _four_node_ring(close_grace_s=0.25)
    sq = iter(range(1, 1000))

    def deliver(header: dict, tensors=()) -> None:
        ring._handle([zmq.Frame(bytes(f)) for f in pack(
            {**header, "src": 1, "inc": 7, "sq": next(sq)}, list(tensors))])

    def pass_sum(step: int, total: list[torch.Tensor]) -> None:  # node 1 closed, 0 is last
        layout = layout_of(total)
        for k, pieces in enumerate(chunk_plan(layout, 64)):
            deliver({"t": "sum", "step": step, "k": k, "origin": 1, "way": 1, "last": 0,
                     "layout": layout}, chunk_tensors(total, pieces))

    sent = []
    ring._send = lambda idx, addr, header, tensors=(): sent.append((header, list(tensors)))
    try:
        with mock.patch("trainwright.tokenring.ring.CHUNK_BYTES", 64):
            first = [torch.randn(7, 5), torch.randn(30)]
            pass_sum(1, first)
            held = ring.sums[1]
            assert all(torch.equal(a, b) for a, b in zip(held, first, strict=True))
            deliver({"t": "fetch", "step": 1, "node": -1})
            assert sent and all(h["t"] == "sum" for h, _ in sent)
            bases = {t.untyped_storage().data_ptr() for t in held}
            assert not {t.untyped_storage().data_ptr() for _, ts in sent for t in ts} & bases
            ring.note_applied(1 + RETAIN_STEPS)
            assert 1 not in ring.sums
            later = [torch.randn(7, 5), torch.randn(30)]
            pass_sum(2 + RETAIN_STEPS, later)
            got = ring.sums[2 + RETAIN_STEPS]
            assert all(a is b for a, b in zip(got, held, strict=True))  # the same tensors
            assert all(torch.equal(a, b) for a, b in zip(got, later, strict=True))
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("members", [[0, 1], [0, 1, 2, 3]])
def test_a_closed_sum_lost_with_its_dead_contributors_fails_the_ring(members):
    """Step 2 closed with [3, 0, 1, 2]; nodes 2 and 3 applied it and were killed before
    passing the sum on (seen in the three-kill test on a loaded host). Nodes 0 and 1 hold only
    their own gradients: once 2 and 3 are out of the ring the sum is gone, which fails the
    ring (the first member saves); while they are members it is a time-out to report."""
    from trainwright.tokenring.ring import RingFailed, RingTimes, TokenRing

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    epoch = Epoch((2, 0), {i: f"tcp://127.0.0.1:{9000 + i}" for i in members})
    ring = TokenRing(ctx, 0, pull, epoch, close_fraction=0.75, min_nodes=2, total_steps=10,
                     times=RingTimes(close_timeout_s=2.5, fetch_after_s=0.01), applied=1,
                     closes={1: [0, 1, 2, 3], 2: [3, 0, 1, 2]}, clock=FakeClock(tick=1.0))
    try:
        for c in (0, 1):
            ring.grads[(2, c)] = [torch.ones(3)]
        with pytest.raises(CommError) as got:
            ring.summed(2, ring.close_of(2))
        lost = len(members) == 2
        assert (type(got.value) is RingFailed) == lost, got.value
        assert ("was lost with node(s) [3, 2]" if lost else "never arrived") in str(got.value)
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_a_token_the_dead_holder_sent_to_some_members_only_is_relayed_to_its_successor():
    """Node 2 closed step 2 and sent the token (step 3, holder 3) to node 0, then was killed
    before the copy to node 3 left. Node 0 relays it after token_timeout_s of silence, so
    node 3 takes the token instead of dropping node 2 from a token still at step 2."""
    from trainwright.tokenring.ring import RingTimes, Token, TokenRing

    ctx = zmq.Context()
    pulls = {i: ctx.socket(zmq.PULL) for i in (0, 3)}
    ports = {i: s.bind_to_random_port("tcp://127.0.0.1") for i, s in pulls.items()}
    members = {0: f"tcp://127.0.0.1:{ports[0]}", 2: "tcp://127.0.0.1:1", 3:
               f"tcp://127.0.0.1:{ports[3]}"}
    epoch = Epoch((1, 2), members)
    times = RingTimes(token_timeout_s=0.25, succession_s=0.5)
    closes = {1: [0, 1, 2, 3]}
    clock = FakeClock()
    rings = {i: TokenRing(ctx, i, pulls[i], epoch, close_fraction=0.75, min_nodes=2,
                          total_steps=10, times=times, closes=closes if i == 0 else {},
                          token=Token(2, [0, 3], 2, 4, 0), applied=1, clock=clock)
             for i in (0, 3)}
    try:
        # what node 0 got: the token's notice, past the epoch's first hops (its key only)
        # and with the last close only
        last = {**token_header(Token(3, [], 3, 9), epoch, {1: [0, 1, 2, 3], 2: [0, 2, 3]},
                               to_holder=False), "src": 2, "inc": 7, "sq": 1}
        assert "members" not in last["ep"] and list(last["closes"]) == ["2"]
        rings[0]._handle([zmq.Frame(bytes(f)) for f in pack(last, [])])
        assert rings[0].closes[2] == [0, 2, 3] and rings[0].tok.holder == 3
        clock.advance(times.token_timeout_s)  # not yet silent for longer than the time-out
        with rings[0].cv:
            rings[0]._check_silence()
        assert rings[0].stats.retransmissions == 0
        # quiet past the time-out, before node 0 (holder 3's successor) would announce it
        clock.advance(times.succession_s / 2)
        with rings[0].cv:
            rings[0]._check_silence()
        assert rings[0].stats.retransmissions == 1
        assert rings[0].epoch.key == (1, 2)  # node 0 is not node 2's successor
        assert pulls[3].poll(30_000), "node 0 did not relay the token"
        relayed = pulls[3].recv_multipart(copy=False)
        assert "members" in json.loads(relayed[0].bytes)["ep"]  # the relay is whole
        rings[3]._handle(relayed)
        assert rings[3].epoch.key == (1, 2) and rings[3].tok.holder == 3
        assert rings[3].tok.step == 3 and rings[3].closes == {1: [0, 1, 2, 3], 2: [0, 2, 3]}
    finally:
        _stop_rings(ctx, *rings.values())


@pytest.mark.timeout(30)
def test_a_new_epochs_membership_comes_with_its_first_hops_and_a_node_that_missed_it_leaves():
    """Token notices carry the membership only in an epoch's first 2 n hops. A member that
    hears a later notice of an epoch it never saw cannot know whether it is still in it:
    it leaves (and rejoins with fresh weights) with one line saying why."""
    from trainwright.tokenring.ring import RingTimes, Token, TokenRing

    ctx = zmq.Context()
    pulls = {i: ctx.socket(zmq.PULL) for i in (0, 1)}
    for sock in pulls.values():
        sock.bind_to_random_port("tcp://127.0.0.1")
    old = Epoch((1, 0), {i: f"tcp://127.0.0.1:{9000 + i}" for i in range(4)})
    new = old.without(2, 3)
    rings = {i: TokenRing(ctx, i, pulls[i], old, close_fraction=0.75, min_nodes=2,
                          total_steps=10, times=RingTimes(), closes={1: [0, 1, 2, 3]},
                          token=Token(2, [], 2, 4), applied=1, clock=FakeClock())
             for i in (0, 1)}
    link = {"src": 3, "inc": 7, "sq": 1}
    try:
        early = token_header(Token(2, [3], 0, 1), new, {1: [0, 1, 2, 3]}, to_holder=False)
        rings[0]._handle([zmq.Frame(bytes(f)) for f in pack({**early, **link}, [])])
        assert rings[0].epoch == new and rings[0].status == "running"
        late = token_header(Token(2, [3], 0, 2 * 3), new, {1: [0, 1, 2, 3]}, to_holder=False)
        assert "members" not in late["ep"]
        rings[1]._handle([zmq.Frame(bytes(f)) for f in pack({**late, **link}, [])])
        assert rings[1].epoch == old and rings[1].status == "left"
        assert "formed while this node was out of reach" in rings[1].reason
    finally:
        _stop_rings(ctx, *rings.values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pace_s,tells", [(0.0, True), (0.03, True), (5.0, False)])
def test_a_node_ready_after_its_step_closed_tells_the_ring_unless_far_behind(tmp_path, pace_s,
                                                                              tells):
    """Step 1 closed without node 0. Its gradient is ready now (no pacing), or its emulated
    device would be ready within the grace's cap (30 ms of pacing left, cap 50 ms): it says
    so, and the grace counts it as a little late. Five seconds of pacing left: far behind,
    it says nothing (the ring counts it as never ready)."""
    from trainwright.tokenring.exchange import RingExchange

    cfg = ring_cfg(tmp_path, **{"tokenring.pace_s": pace_s, "tokenring.close_grace_s": 0.05})
    ctx, pull, clock, ring = _four_node_ring(close_grace_s=0.05)
    try:
        ex = RingExchange(cfg.tokenring, 0)
        ex.use(ring, applied=0)
        ring.closes[1] = [1, 2, 3]
        ex._step, ex._t0 = 1, time.perf_counter()
        weight = torch.zeros(3, requires_grad=True)
        weight.grad = torch.ones(3)
        ex.sync([weight])
        assert ring.grace.is_ready(1, 0) == tells
        assert (ring._late_want == 1) == tells
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_formation_closes_after_quiet_s_without_a_join_and_fails_past_its_deadline():
    from trainwright.errors import CommError
    from trainwright.tokenring.membership import Rendezvous

    ctx = zmq.Context()
    try:
        # 1 s per reading of the clock: quiet_s = 10 passes after a dozen polls of the socket
        rdzv = Rendezvous(ctx, "tcp://127.0.0.1:*", 4, quiet_s=10.0, clock=FakeClock(tick=1.0))
        assert rdzv.form(0, "tcp://127.0.0.1:1", min_nodes=1, deadline_s=1000) == {
            0: "tcp://127.0.0.1:1"}
        assert rdzv.formed and 10 < rdzv.clock() < 40
        rdzv.close()
        rdzv = Rendezvous(ctx, "tcp://127.0.0.1:*", 4, quiet_s=10.0, clock=FakeClock(tick=1.0))
        with pytest.raises(CommError, match=r"only 1 node\(s\) joined in 30 s, need "
                                            r"tokenring.min_nodes = 2"):
            rdzv.form(0, "tcp://127.0.0.1:1", min_nodes=2, deadline_s=30)
        assert not rdzv.formed
        rdzv.close()
    finally:
        ctx.term()


@pytest.mark.timeout(30)
def test_transient_straggler_pattern_is_seeded_and_shared(tmp_path):
    from trainwright.tokenring.exchange import is_slow, transient_slow

    draws = [transient_slow(7, s, n, 0.2) for s in range(1, 501) for n in range(4)]
    assert draws == [transient_slow(7, s, n, 0.2) for s in range(1, 501) for n in range(4)]
    assert 0.15 < sum(draws) / len(draws) < 0.25  # independent draws at p = 0.2
    assert draws != [transient_slow(8, s, n, 0.2) for s in range(1, 501) for n in range(4)]
    assert not any(transient_slow(7, s, 0, 0.0) for s in range(100))
    cfg = ring_cfg(tmp_path, **{"tokenring.slow_node": 3, "tokenring.slow_factor": 3.0})
    assert all(is_slow(cfg.tokenring, 3, s) for s in range(1, 20))
    assert not any(is_slow(cfg.tokenring, 1, s) for s in range(1, 20))


# ---------------------------------------------------------------- 4 node processes
@pytest.mark.timeout(150)  # 4-10 s idle: 4 node processes start on a shared host
def test_no_faults_equals_synchronous_data_parallel(tmp_path):
    cfg = ring_cfg(tmp_path)
    result = run_ring(cfg)
    assert result.ok, result.message()
    reps = result.reports
    assert sorted(reps) == ["0", "1", "2", "3"]
    for r in reps.values():
        assert r["contributed"] == [1, 2, 3, 4, 5] and r["gaps"] == 0
        assert all(sorted(c) == [0, 1, 2, 3] for c in r["closes"].values())
    assert_identical_replicas(reps, range(1, 6))
    # the sum travels with the token and then once round the ring: each node sends about
    # two gradients per step (not n - 1 copies of its own), and nothing was rebuilt
    for r in reps.values():
        assert r["steps_applied"] == 5 and r["grad_bytes"] > 0
        assert 0.5 <= r["tensor_bytes_sent_per_step_over_grad"] <= 2.5, r
        assert r["sums_rebuilt"] == 0 and r["running_sums_dropped"] == 0
    # reference: one process, whole global batch, w <- w - lr * grad
    model = nn.Sequential(*[m for _, m in build_layers(cfg)])
    data, lossf = build_data(cfg), loss_fn(cfg)
    for step in range(1, 6):
        x, y = data.batch(step, cfg.train.batch_size)
        grads = torch.autograd.grad(lossf(model(x), y), list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p.sub_(cfg.train.lr * g)
    saved = torch.load(result.run_dir / "model.pt")
    torch.testing.assert_close(saved, model.state_dict())


@pytest.mark.timeout(150)  # 4-10 s idle: 4 node processes start on a shared host
def test_straggler_is_left_out_and_replicas_stay_identical(tmp_path):
    # the plain closing rule (no grace): the node a few ms late is left out at once
    cfg = ring_cfg(tmp_path, **{"tokenring.close_fraction": 0.75, "tokenring.slow_node": 3,
                                "tokenring.close_grace_s": 0.0,
                                "tokenring.slow_factor": 5.0, "train.steps": 16,
                                "model.d_in": 64, "model.d_model": 384,
                                "train.batch_size": 512})
    result = run_ring(cfg)
    assert result.ok, result.message()
    reps = result.reports
    assert_identical_replicas(reps, range(1, 17))
    assert all(len(r["hashes"]) == 16 for r in reps.values())  # the straggler applies all
    closes = reps["0"]["closes"]
    assert all(len(c) >= 3 for c in closes.values())
    without = [s for s, c in closes.items() if 3 not in c]
    assert len(without) >= 12, f"the 5x slower node was waited for: {closes}"
    assert len(reps["3"]["contributed"]) <= 4


@pytest.mark.timeout(150)  # 4-10 s idle: 4 node processes start on a shared host
def test_killed_node_is_dropped_and_rejoins_with_current_weights(tmp_path):
    # RING_TIMEOUTS: with 0.5 s a live holder busy computing on 2 shared cores was once
    # silent for 0.8 s and dropped, a second "lost" the test does not expect
    cfg = ring_cfg(tmp_path, **{"tokenring.close_fraction": 0.75, "tokenring.kill_nodes": [2],
                                "tokenring.kill_step": 3, "tokenring.restart_killed": "true",
                                "tokenring.batch_steps": 5, "train.steps": 40,
                                "model.d_in": 64, "model.d_model": 256,
                                "train.batch_size": 256})
    result = run_ring(cfg)
    assert result.ok, result.message()
    assert result.returncodes["2"] == -9 and result.returncodes["2r"] == 0
    reps = result.reports
    lost = [e for r in reps.values() for e in r["events"] if e["event"] == "lost"]
    assert [e["node"] for e in lost] == [2]  # announced once, by one successor
    assert lost[0]["members"] == [0, 1, 3]
    back = reps["2r"]["joined"][0]
    assert back["as"] == "standby" and back["applied"] % 5 == 0 and back["applied"] >= 5
    b = back["applied"]
    # between the kill and the rejoin the ring closed steps without node 2
    closes = {int(s): c for s, c in reps["0"]["closes"].items()}
    assert all(2 not in closes[s] for s in range(4, b + 1))
    assert all(len(c) == 3 for s, c in closes.items() if 3 < s <= b)
    # the rejoined node applies every later step and matches the others bit for bit
    assert sorted(int(s) for s in reps["2r"]["hashes"]) == list(range(b + 1, 41))
    assert_identical_replicas(reps, range(1, 41))
    admits = [e for e in reps["0"]["events"] if e["event"] == "admit"]
    assert [(e["nodes"], e["at_step"]) for e in admits] == [([2], b)]
    for k in ("1", "3"):  # the others adopted the epoch that has node 2 again
        assert reps[k]["events"][-1]["members"] == [0, 1, 2, 3]


@pytest.mark.timeout(150)  # 4-10 s idle: 4 node processes start on a shared host
def test_three_of_four_killed_survivor_saves_and_the_command_fails(tmp_path, capfd):
    from trainwright.cli import main

    # token_timeout_s 1.5 as in the rejoin test: a live node silent for 0.5 s on a loaded host
    # would be dropped, an extra "lost". (The failure once seen here was a killed holder's
    # token reaching node 0 but not its successor: see the relay test above.)

    argv = ["run", "--set", "sync.strategy=tokenring", "--set", "train.optimizer=sgd",
             "--set", "model.name=mlp", "--set", "model.d_in=16", "--set", "model.d_model=32",
             "--set", "model.n_blocks=2", "--set", "train.batch_size=32",
             "--set", "train.steps=30", "--set", "train.lr=0.1",
             "--set", "tokenring.close_fraction=0.75", "--set", "tokenring.kill_nodes=[1,2,3]",
             "--set", "tokenring.kill_step=3", "--set", "tokenring.token_timeout_s=1.5",
             "--set", "tokenring.succession_s=0.3", "--set", "tokenring.close_timeout_s=10",
             "--set", f"run.dir='{tmp_path / 'runs'}'", "--set", "run.name=fail"]
    assert main(argv) == 1
    err = capfd.readouterr().err
    run_dir = tmp_path / "runs" / "fail"
    assert "token ring run failed" in err and "saved to" in err
    rep = json.loads((run_dir / "node0.json").read_text())
    assert rep["status"] == "failed"
    if "was lost with node(s)" in err:
        # two of the three applied step 2 and were killed in step 3 before passing its sum
        # on (5 of 27 runs beside a CPU hog): nobody left can apply step 2, and the third,
        # never reaching step 3, is not killed; both survivors fail the ring
        reports = [run_dir / f"node{k}.json" for k in (1, 2, 3)]
        alive = [json.loads(r.read_text()) for r in reports if r.exists()]
        assert [a["status"] for a in alive] == ["failed"] and "min_nodes" not in err
    else:
        assert "node(s) [1, 2, 3] lost" in err and "min_nodes = 2" in err
        for k in (1, 2, 3):
            assert not (run_dir / f"node{k}.json").exists()  # they died by SIGKILL
    saved = torch.load(run_dir / "model.pt")
    last = max(rep["hashes"], key=int)
    # killed in step 3, after their gradients: step 2 closed on the ring, but node 0 learns
    # of a close when the token next reaches it, which the kills may cut (seen once on a
    # loaded host: node 0 knew step 1 only); it saves the last step it knows closed
    assert last in ("1", "2"), rep["hashes"]
    assert param_hash(list(saved.values())) == rep["hashes"][last]


@pytest.mark.timeout(30)
def test_straggler_pairs_keep_a_round_where_a_system_missed_at_the_time_limit():
    from trainwright.bench.straggler import _paired_or_miss

    got = _paired_or_miss([2.0, None, 3.0, None], [4.0, 5.0, None, None], limit_s=10.0)
    assert got["paired_ratios"] == [0.5, 2.0, 0.3, 1.0]  # nothing dropped
    assert got["ratio"] == 0.75 and got["time_limit_s"] == 10.0
    assert got["rounds_at_limit"] == [{"round": 1, "missed": ["numerator"]},
                                      {"round": 2, "missed": ["denominator"]},
                                      {"round": 3, "missed": ["numerator", "denominator"]}]
    # where the ring never got there its ratio is a lower bound: an "at most" target fails
    from trainwright.bench.straggler import StragglerSpec, summarise

    def run_of(t, ring):
        got = {"time_to_target_s": t, "steps_to_target": None, "committed_fraction": 1.0,
               "curve": [[0.1, 0.1]]}
        return {**got, "steps_without_all_nodes": 0, "samples_skipped": 0,
                "busiest_node_bytes_per_step_over_grad": 2.0} if ring else got

    out = summarise({("trainwright_tokenring", "none"): [run_of(None, True), run_of(5, True)],
                     ("torch_ddp", "none"): [run_of(None, False), run_of(6, False)]},
                    StragglerSpec(steps=1), 2)
    block = out["ratio_none_vs_ddp_judged"]
    assert block["interval"][1] <= 1.02 and block["verdict"] == "missed" and "[0]" in block["why"]
    assert out["targets_met"] == {"ratio_none_vs_ddp": False,
                                  "busiest_node_bytes_per_step_over_grad": True}


@pytest.mark.timeout(600)  # ~40 s idle; process start-ups dominate on a loaded host
def test_bench_straggler_runs_tiny():
    import statistics

    from trainwright.bench.straggler import StragglerSpec, run, slow_pattern

    # two nodes keep the start-up cost (torch + scikit-learn per process) small
    spec = StragglerSpec(nodes=2, hidden=32, batch_size=128, steps=6, pace_s=0.03,
                         slow_probability=0.5, target_accuracy=0.5, lr=1.0)
    runs = (("trainwright_tokenring", "transient"), ("torch_ddp", "transient"))
    result = run(spec, repeats=2, runs=runs)
    rows = {(r["system"], r["scenario"]): r for r in result["rows"]}
    assert set(rows) == set(runs)
    for row in rows.values():
        for curve in row["accuracy_curves"]:  # one point per step, times rising
            assert len(curve) == 6 and all(0 <= acc <= 1 for _, acc in curve)
            assert [t for t, _ in curve] == sorted(t for t, _ in curve) and curve[0][0] > 0
    # time to target: the first point of each round's curve at or above the target
    ours, ddp = (rows[k]["time_to_target_s_rounds"] for k in runs)
    for row, times in ((rows[runs[0]], ours), (rows[runs[1]], ddp)):
        for curve, t in zip(row["accuracy_curves"], times, strict=True):
            assert t == next((p[0] for p in curve if p[1] >= 0.5), None)
    # a round where a system never reached the target is kept, at the bench's time limit:
    # the ratio is always a number (it once was None == None when both missed)
    lim = spec.time_limit_s
    fill = [(lim if a is None else a, lim if b is None else b)
            for a, b in zip(ours, ddp, strict=True)]
    ratio = result["ratio_transient_vs_ddp"]
    assert isinstance(ratio, float) and ratio > 0
    assert ratio == round(statistics.median(a / b for a, b in fill), 4)
    assert [r["round"] for r in result["ratio_transient_vs_ddp_paired"]["rounds_at_limit"]] == [
        i for i, (a, b) in enumerate(zip(ours, ddp, strict=True)) if a is None or b is None]
    block = result["ratio_transient_vs_ddp_judged"]
    assert block["median"] == ratio and block["target"] == 0.55
    ring_missed = any(a is None for a in ours)  # a lower bound only: never "met"
    assert block["verdict"] == ("met" if block["interval"][1] <= 0.55 and not ring_missed
                                else "missed")
    assert result["ratio"] == ratio
    busiest = rows[runs[0]]["busiest_node_bytes_per_step_over_grad_rounds"]
    assert len(busiest) == 2 and all(b > 0 for b in busiest)
    assert result["busiest_node_bytes_per_step_over_grad"] == max(busiest)
    assert rows[runs[0]]["samples_skipped_rounds"] == [0, 0]
    assert "ratio_none_vs_ddp" not in result  # not measured here
    # the pattern is seeded and shared: at p = 0.5 some steps have slow nodes
    assert result["spec"]["transient_slow_nodes_per_step"] == slow_pattern(spec)
    assert any(slow_pattern(spec))
    assert result["host"]["cpus"] >= 1


@pytest.mark.timeout(30)
def test_adaptive_grace_follows_the_arrival_spread_and_waits_for_a_ready_node():
    from trainwright.tokenring.grace import AdaptiveGrace
    from trainwright.tokenring.ring import Token

    g = AdaptiveGrace(cap_s=0.5, factor=2.0, window=3)
    assert g.grace_s() == 0.5  # nothing measured yet: the cap
    for step, spread in ((1, 0.010), (2, 0.030), (3, 0.020)):
        g.ready(step, 0, 10.0)
        g.ready(step, 1, 10.0 + spread)
        assert g.measure(2, 2, 10.0 + spread) == [pytest.approx(spread)]  # both ready
        assert g.measure(2, 2, 10.0 + spread) == []  # once per step
    assert g.grace_s() == pytest.approx(0.040)  # 2 x median(10, 30, 20 ms)
    for step in (4, 5, 6):  # a slower host: the spread grows, the window forgets the old
        g.ready(step, 0, 0.0)
        g.ready(step, 1, 1.0)
        g.measure(2, 2, 1.0)
    assert g.grace_s() == 0.5  # 2 s to the quorum, capped

    # on-time nodes arrive staggered (they start when the closed sum reaches them, hop after
    # hop): the last one, 30 ms after the first, counts, not the quorum's second at 10 ms;
    # one 3x slower (0.4 s) does not
    g = AdaptiveGrace(cap_s=0.1, factor=2.0, window=3)
    for node, at in ((0, 0.0), (1, 0.010), (2, 0.020), (3, 0.030)):
        g.ready(7, node, at)
    assert g.measure(4, 2, 0.030) == [pytest.approx(0.030)]
    for node, at in ((0, 1.0), (1, 1.010), (2, 1.020)):
        g.ready(8, node, at)
    assert g.measure(4, 2, 1.05) == []  # node 3 may still come within the cap
    g.ready(8, 3, 1.4)
    assert g.measure(4, 2, 1.4) == [pytest.approx(0.020)]
    assert g.grace_s() == pytest.approx(0.050)

    # before any step's spread is recorded, every on-time arrival lengthens the grace
    # (members start the first step as their welcome arrives, up to 15 ms apart)
    g = AdaptiveGrace(cap_s=0.1, factor=2.0)
    g.ready(1, 0, 0.0)
    g.ready(1, 1, 0.002)
    assert g.measure(4, 2, 0.002) == [] and g.grace_s() == pytest.approx(0.004)
    g.ready(1, 2, 0.010)
    assert g.measure(4, 2, 0.010) == [] and g.grace_s() == pytest.approx(0.020)

    ctx, pull, clock, ring = _four_node_ring(close_grace_s=1.0)
    try:
        for step in (1, 2):  # on-time nodes ready 4 ms apart: the grace becomes 24 ms
            for node in range(4):
                ring.grace.ready(step, node, clock.now + node * 0.004)
            clock.advance(0.012)
            assert ring._may_close(Token(step, [0, 1, 2, 3], 0, 1))  # all in: at once
        assert ring.grace.grace_s() == pytest.approx(0.024)
        half = Token(3, [0, 1], 0, 1)
        ring.grace.ready(3, 0, clock.now)
        ring.grace.ready(3, 1, clock.now + 0.004)
        assert not ring._may_close(half)  # the quorum: the grace starts
        clock.advance(0.023)
        assert not ring._may_close(half)  # the last on-time node would still make it
        clock.advance(0.001)
        assert ring._may_close(half)  # 24 ms, not the 1 s cap
        late = Token(4, [0, 1], 0, 1)
        for node in (0, 1, 3):  # node 3 said it is ready: never cut off
            ring.grace.ready(4, node, clock.now)
        assert not ring._may_close(late)
        clock.advance(10)
        assert not ring._may_close(late)
        late.contribs.append(3)
        assert ring._may_close(late)  # 3 of 4, node 2 not ready, the grace long gone
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_a_node_far_behind_in_step_after_step_costs_no_grace():
    """Node 3 misses three closes by more than the cap (ready 0.5 s after the close, or never
    ready): the next step closes at the quorum. Ready within the cap after one close, and
    the grace waits for it again; a missing node not known late is always waited for."""
    from trainwright.tokenring.grace import LATE_STEPS, AdaptiveGrace
    from trainwright.tokenring.ring import Token

    g = AdaptiveGrace(cap_s=0.1)
    for step in range(1, LATE_STEPS + 1):
        g.closed(step, 10.0 * step, missing={3})
        if step != 2:  # in step 2 node 3 never said it was ready
            g.ready(step, 3, 10.0 * step + 0.5)
    assert not g.known_late(3, 10.0 * LATE_STEPS + 0.05)  # the last close's verdict not in
    assert g.known_late(3, 10.0 * LATE_STEPS + 0.1)
    assert not g.known_late(2, 100.0)  # it made every close
    g.closed(LATE_STEPS + 1, 50.0, missing={3})
    g.ready(LATE_STEPS + 1, 3, 50.09)  # a little late only: within the cap
    assert not g.known_late(3, 60.0)

    ctx, pull, clock, ring = _four_node_ring(close_grace_s=1.0)
    try:
        for step in range(1, LATE_STEPS + 1):  # 0-2 ready 4 ms apart, 3 two seconds late
            for node in range(3):
                ring.grace.ready(step, node, clock.now + node * 0.004)
            t = Token(step, [0, 1], 0, 1)
            assert not ring._may_close(t)  # 3 not known late yet: the grace runs
            t.contribs.append(2)
            clock.advance(0.02)  # past the grace: 2 x the on-time spread, 8 ms
            assert ring._may_close(t)
            ring.grace.closed(step, clock.now, missing={3})
            clock.advance(2.0)
            ring.grace.ready(step, 3, clock.now)
        quorum = Token(LATE_STEPS + 1, [0, 1, 2], 0, 1)
        for node in range(3):
            ring.grace.ready(LATE_STEPS + 1, node, clock.now)
        assert ring._may_close(quorum)  # only node 3 missing, known late: no grace
        quorum = Token(LATE_STEPS + 1, [0, 1, 3], 0, 1)
        assert not ring._may_close(quorum)  # node 2 missing: it gets its grace
    finally:
        _stop_rings(ctx, ring)


@pytest.mark.timeout(30)
def test_work_queue_trains_every_unit_once_whatever_the_closes():
    import random

    from trainwright.tokenring.work import WorkQueue

    q = WorkQueue(4)
    assert q.close(1, [0, 1, 2, 3]) == {0: (1, 0), 1: (1, 1), 2: (1, 2), 3: (1, 3)}
    assert q.close(2, [3, 0, 1]) == {0: (2, 0), 1: (2, 1), 3: (2, 3)}  # node 2 late
    assert q.backlog == [(2, 2)]
    # node 2's unit goes to the first of the last contributors; fresh units fill the rest
    assert q.assignment() == [(2, 2), (3, 0), (3, 2), (3, 1)]
    assert q.close(3, [0, 1, 3]) == {0: (2, 2), 1: (3, 0), 3: (3, 1)}
    assert q.backlog == [(3, 2)] and q.skipped() == 0
    with pytest.raises(ValueError, match="in order"):
        q.close(5, [0])
    back = WorkQueue.from_json(q.to_json())  # a welcome carries it
    assert back.assignment() == q.assignment() and back.skipped() == 0
    rng = random.Random(0)  # random closes, node 0 dead from step 10 on: nothing lost
    q, seen = WorkQueue(4), []
    for step in range(1, 201):
        members = [1, 2, 3] if step >= 10 else [0, 1, 2, 3]
        got = q.close(step, rng.sample(members, rng.randint(1, len(members))))
        seen += got.values()
    assert len(seen) == len(set(seen)) and q.skipped() == 0
    done = set(seen) | set(q.backlog)
    assert done == {(u // 4 + 1, u % 4) for u in range(q.fresh)}
    oldest = min(q.backlog)[0]  # the backlog is trained oldest first: it stays recent
    assert oldest > q.fresh // 4 - 10


@pytest.mark.timeout(150)  # 4-10 s idle: 4 node processes start on a shared host
def test_a_dropped_nodes_share_is_trained_by_the_others_every_sample_once(tmp_path):
    """Node 2 is killed in step 3 (not restarted): its unit of step 3 and every later one is
    trained by the others one step later, so every image of the first epoch is trained
    exactly once, and none of any epoch twice; replicas stay bit-identical."""
    from trainwright.bench.straggler import DigitsData

    cfg = ring_cfg(tmp_path, **{"tokenring.close_fraction": 0.75, "tokenring.kill_nodes": [2],
                                "tokenring.kill_step": 3, "train.steps": 12,
                                "data.factory": '"trainwright.bench.straggler:digits_data"',
                                "model.d_in": 64, "model.n_classes": 10,
                                "train.batch_size": 256})
    result = run_ring(cfg)
    assert result.ok, result.message()
    reps = result.reports
    assert result.returncodes["2"] == -9 and "2" not in reps
    assert_identical_replicas(reps, range(1, 13))
    closes = {int(s): c for s, c in reps["0"]["closes"].items()}
    assert all(2 not in closes[s] for s in range(3, 13)), closes
    work = {int(s): {int(c): tuple(u) for c, u in units.items()}
            for s, units in reps["0"]["trained_units"].items()}
    assert sorted(work) == list(range(1, 13))
    for s, units in work.items():
        assert sorted(units) == sorted(closes[s])  # one unit per contributor
    for k in ("1", "3"):  # what each node read is what node 0 says it trained
        for s, u in reps[k]["read_units"].items():
            if int(k) in work[int(s)]:
                assert tuple(u) == work[int(s)][int(k)]
        assert reps[k]["samples_trained"] == 64 * sum(int(k) in c for c in closes.values())
    assert all(r["samples_skipped"] == 0 for r in reps.values())
    data, shard = DigitsData(cfg.train.seed), 64
    per_epoch = data.steps_per_epoch(256)  # 5 steps of 256 images
    trained = [int(i) for units in work.values() for t, j in units.values()
               if t <= per_epoch for i in data.indices(t, 256)[j * shard:(j + 1) * shard]]
    first = [int(i) for t in range(1, per_epoch + 1) for i in data.indices(t, 256)]
    assert len(set(first)) == len(first) == 1280
    assert sorted(trained) == sorted(first), "an image of epoch 1 trained twice or never"
    units = [u for units in work.values() for u in units.values()]
    assert len(units) == len(set(units))  # no unit of any epoch twice
    assert max(t for t, _ in units) > per_epoch  # the run went past epoch 1


@pytest.mark.timeout(30)
def test_scale_model_against_hand_arithmetic():
    from trainwright.tokenring.scale import ScaleModel, message_bytes, simulate

    m = ScaleModel(grad_bytes=1e6, compute_s=0.1, slow_factor=3.0, alpha_s=1e-4, beta=1e9,
                   chunk_bytes=1e5, want_bytes=0)
    whole, notice = message_bytes(4)
    assert 100 < notice < 500 < whole < message_bytes(8)[0]  # the whole token grows ...
    assert message_bytes(256)[1] < 2000  # ... the notice to every member barely
    ddp = simulate(m, 4, straggler=True)["torch_ddp"]
    assert ddp["step_s"] == pytest.approx(0.3 + 6 * (1e-4 + 2.5e5 / 1e9))
    assert ddp["busiest_bytes_over_grad"] == pytest.approx(1.5)
    ring = simulate(m, 4, straggler=False)["tokenring"]
    headers = whole + 2 * notice
    hop = 1e-4 + (1e6 + headers) / 1e9
    pass_s = (1e-4 + headers / 1e9) + 1e6 / 1e9 + 3 * (1e-4 + 1e5 / 1e9)
    assert ring["step_s"] == pytest.approx(0.1 + 3 * hop + pass_s)
    assert ring["busiest_bytes_over_grad"] == pytest.approx((2e6 + whole + 3 * notice) / 1e6)
    slow = simulate(m, 4, straggler=True)
    assert slow["tokenring"]["step_s"] == pytest.approx(0.1 + 2 * hop + pass_s)  # 3 add
    assert slow["tokenring"]["step_s"] < slow["torch_ddp"]["step_s"]
    big = simulate(ScaleModel(grad_bytes=400e6), 256, straggler=False)
    assert big["tokenring"]["busiest_bytes_over_grad"] <= 2.5
    assert big["tokenring_pipelined_sum"]["step_s"] < big["tokenring"]["step_s"]
    bench = simulate(ScaleModel(), 256, straggler=True)  # the straggler bench's 1.2 MB MLP
    assert bench["tokenring"]["busiest_bytes_over_grad"] <= 2.5
