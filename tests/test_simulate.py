"""The schedule simulator: step times and peaks against closed forms, contention, deadlocks."""

from __future__ import annotations

import pytest

from trainwright.plan.simulate import Deadlock, Links, StageCost, liveness, simulate
from trainwright.schedule.actions import Action, ActionKind, build_schedule
from trainwright.schedule.peer import PeerAction, with_peer_swap

pytestmark = pytest.mark.timeout(60)


def _links(n, bw=1e12, latency=0.0):
    return Links(list(range(n)), [[0 if i == j else bw for j in range(n)] for i in range(n)],
                 host_bandwidth=1e12, latency_s=latency)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 5)])
def test_step_time_and_peaks_match_closed_forms(name, p, m):
    f, b, held = 1.0, 2.0, 100
    costs = [StageCost(f, b, send_bytes=0, held_bytes=held) for _ in range(p)]
    r = simulate(build_schedule(name, p, m), costs, _links(p))
    assert r.step_s == pytest.approx((m + p - 1) * (f + b))
    for s in range(p):
        k = m if name == "gpipe" else min(p - s, m)
        assert r.own_peak_bytes[s] == k * held
        assert r.bubble[s] == pytest.approx(1 - m * (f + b) / r.step_s)


def test_link_transfers_add_latency_and_bandwidth():
    costs = [StageCost(1.0, 1.0, send_bytes=10**9) for _ in range(2)]
    fast = simulate(build_schedule("gpipe", 2, 1), costs, _links(2, bw=1e9, latency=0.5))
    # F0 (1) + send (0.5 + 1) + F1 (1) + B1 (1) + grad back (1.5) + B0 (1)
    assert fast.step_s == pytest.approx(7.0)


def test_contention_on_a_shared_link_serialises_transfers():
    # stage 0 sends two micro-batches back to back; each takes 2 s on the link
    costs = [StageCost(0.0, 0.0, send_bytes=2 * 10**9), StageCost(0.0, 0.0)]
    r = simulate(build_schedule("gpipe", 2, 2), costs, _links(2, bw=1e9))
    arrivals = sorted(e for (s, k, mb, st, e) in r.timeline if k == ActionKind.RECV_F)
    assert arrivals == pytest.approx([2.0, 4.0])


def test_point_to_point_is_a_rendezvous():
    # stage 1 is busy with F(0) until 6.5 s; the activation of micro-batch 1, sent at 2 s,
    # only moves once RECV_F(1) is posted (gloo and NCCL), so it arrives at 6.5 + 0.5
    costs = [StageCost(1.0, 1.0), StageCost(5.0, 1.0)]
    r = simulate(build_schedule("gpipe", 2, 2), costs, _links(2, latency=0.5))
    ends = {(s, k, mb): (st, e) for s, k, mb, st, e in r.timeline}
    assert ends[(0, ActionKind.SEND_F, 1)][0] == pytest.approx(2.0)
    assert ends[(1, ActionKind.RECV_F, 1)] == pytest.approx((6.5, 7.0))
    # SYNC drains the stage's sends: it waits until they arrived
    assert ends[(1, ActionKind.SYNC, -1)][0] >= ends[(0, ActionKind.RECV_B, 0)][1]


@pytest.mark.parametrize("seconds", [1.0, 3.0])
def test_peer_chunks_move_while_their_forward_runs(seconds):
    """The pack hook posts each chunk during F(m): PEER_SEND waits only for what is left."""
    sched = with_peer_swap(build_schedule("1f1b", 2, 2), {0: [1]})
    costs = [StageCost(2.0, 2.0, peer_bytes={1: int(seconds * 1e9)}), StageCost(1.0, 1.0)]
    r = simulate(sched, costs, _links(2, bw=1e9))
    ends = {(s, k, mb): (st, e) for s, k, mb, st, e in r.timeline}
    for mb in range(2):
        f0, f1 = ends[(0, ActionKind.F, mb)]
        posted = max(f0, ends[(1, ActionKind.PEER_RECV, mb)][0])
        assert ends[(0, ActionKind.PEER_SEND, mb)][1] == pytest.approx(max(f1, posted + seconds))


def test_deadlock_in_a_broken_hand_made_list_is_found():
    good = build_schedule("gpipe", 2, 1)
    assert simulate(good, [StageCost(1, 1), StageCost(1, 1)], _links(2)).step_s > 0
    # stage 0 waits for the gradient before it sends the activation that produces it
    kinds = (ActionKind.F, ActionKind.RECV_B, ActionKind.SEND_F, ActionKind.B)
    tail = [Action(0, ActionKind.SYNC), Action(0, ActionKind.STEP)]
    broken = [[*(Action(0, k, 0) for k in kinds), *tail], good[1]]
    with pytest.raises(Deadlock, match="0RECV_B0"):
        simulate(broken, [StageCost(1, 1), StageCost(1, 1)], _links(2))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 3)])
def test_peer_swap_actions_never_deadlock_and_peers_hold_at_most_k(name, p, m):
    peers = {0: list(range(1, p)), 1: [p - 1]} if p > 2 else {0: [1]}
    sched = with_peer_swap(build_schedule(name, p, m), peers)
    chunk = 1000
    costs = [StageCost(1.0, 2.0, send_bytes=10, held_bytes=50,
                       peer_bytes={t: chunk for t in peers.get(s, [])}) for s in range(p)]
    r = simulate(sched, costs, _links(p, bw=1e6))
    base = simulate(build_schedule(name, p, m), [StageCost(1.0, 2.0, send_bytes=10,
                                                           held_bytes=50) for _ in range(p)],
                    _links(p, bw=1e6))
    assert r.step_s >= base.step_s
    for t in range(1, p):
        owners = [s for s, ts in peers.items() if t in ts]
        k = {s: (m if name == "gpipe" else min(2 * (p - s), m)) for s in owners}  # + returning
        held_for_peers = r.peak_bytes[t]
        assert held_for_peers <= r.own_peak_bytes[t] + sum(k[s] * chunk for s in owners)
        assert held_for_peers >= base.own_peak_bytes[t] + min(chunk, held_for_peers)
    # owner: k micro-batches of held bytes, plus one micro-batch of chunks in transit
    k0 = m if name == "gpipe" else min(p, m)
    assert r.own_peak_bytes[0] == k0 * 50 + chunk * len(peers[0])


def test_peer_receive_posted_too_late_deadlocks():
    sched = with_peer_swap(build_schedule("1f1b", 2, 2), {0: [1]})
    peer = [a for a in sched[1] if not (a.kind == ActionKind.PEER_RECV and a.mb == 0)]
    i = next(i for i, a in enumerate(peer) if a.kind == ActionKind.PEER_RETURN and a.mb == 0)
    peer.insert(i + 1, PeerAction(1, ActionKind.PEER_RECV, 0, 0))  # after the return it should feed
    costs = [StageCost(1, 1, peer_bytes={1: 10}), StageCost(1, 1)]
    with pytest.raises(Deadlock):
        simulate([sched[0], peer], costs, _links(2))


def test_peers_must_be_later_stages():
    with pytest.raises(ValueError, match="later stages"):
        with_peer_swap(build_schedule("1f1b", 3, 3), {1: [0]})


def test_liveness_intervals_from_the_replay():
    costs = [StageCost(2.0, 4.0, layer_forward_s=[1.0, 1.0], layer_backward_s=[2.0, 2.0])
             for _ in range(2)]
    r = simulate(build_schedule("gpipe", 2, 1), costs, _links(2))
    live = liveness(r, costs, [[0, 1], [2, 3]])
    # stage 1: F at 2..4, B at 4..8: layer 3 packed at 4, unpacked at 4 -> 0; layer 2: 3 -> 6
    assert live[3] == pytest.approx(0.0)
    assert live[2] == pytest.approx(3.0)
    # stage 0: F 0..2, B 8..12: layer 0 packed 1, unpacked 8 + 2 = 10
    assert live[0] == pytest.approx(9.0)


@pytest.mark.timeout(120)
def test_meta_profile_sizes_equal_the_real_ones():
    import torch

    from trainwright.model.gpt import GPTConfig, gpt_layers
    from trainwright.observe.tensor_profile import profile_tensors, profile_tensors_meta

    cfg = GPTConfig(vocab=64, context=16, d_model=32, n_heads=2, n_blocks=2)
    torch.manual_seed(0)
    real = profile_tensors([(str(i), m) for i, m in enumerate(gpt_layers(cfg))],
                           torch.randint(0, 64, (2, 16)), steps=1)
    with torch.device("meta"):
        layers = [(str(i), m) for i, m in enumerate(gpt_layers(cfg))]
        meta = profile_tensors_meta(layers, torch.zeros(2, 16, dtype=torch.long), 1e12, 1e11)
    assert [[t.nbytes for t in x.tensors] for x in meta] == \
        [[t.nbytes for t in x.tensors] for x in real]
    assert [x.output_bytes for x in meta] == [x.output_bytes for x in real]
    assert all(x.forward_s > 0 and x.backward_s == 2 * x.forward_s for x in meta)
    # times laid out forward then backward: every tensor unpacked after it was packed
    assert all(t.unpacked_s >= t.packed_s for x in meta for t in x.tensors)
    assert all(t.unpacked_s > t.packed_s for t in meta[1].tensors)


@pytest.mark.timeout(120)
def test_plan_and_simulate_cli(tmp_path, capsys):
    import json

    from trainwright.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-small", "--meta", "--topology", "dgx1", "--pp", "4",
                 "--global-batch", "8", "--budget", "6MiB", "--gpu-memory", "1GiB",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["pp"] == 4 and len(plan["mapping"]) == 4 and len(set(plan["mapping"])) == 4
    assert plan["predicted"]["step_s"] > 0 and len(plan["predicted"]["peak_bytes"]) == 4
    assert all(plan["fits"])
    assert any(c.get("peer") for c in plan["policy_counts"])  # the heavy stage uses its peers
    png = tmp_path / "timeline.png"
    assert main(["simulate", str(out), "--png", str(png)]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-2])
    assert figures["step_s"] == pytest.approx(plan["predicted"]["step_s"], rel=1e-6)
    assert figures["peak_bytes"] == plan["predicted"]["peak_bytes"]
    assert png.stat().st_size > 1000
    # bad input: one line, exit 2, nothing written
    bad = tmp_path / "bad.json"
    assert main(["plan", "--topology", "nosuch", "--json", str(bad)]) == 2
    assert "not a preset" in capsys.readouterr().err and not bad.exists()
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_calibrated_action_overheads_lengthen_the_step_by_their_closed_form(name):
    from trainwright.plan.calibration import Calibration, with_overheads

    p, m, f, b, n_layers = 2, 4, 1.0, 2.0, 3
    cal = Calibration({}, 2, action_s=0.01, segment_s=0.002, send_s=0.0, recv_s=0.0)
    costs = with_overheads([StageCost(f, b) for _ in range(p)], [n_layers] * p, cal)
    r = simulate(build_schedule(name, p, m), costs, _links(p))
    o = cal.action_s + n_layers * cal.segment_s  # on every F and every B
    assert r.step_s == pytest.approx((m + p - 1) * (f + b + 2 * o))


def test_receive_overhead_is_on_the_critical_path():
    from trainwright.plan.calibration import Calibration, with_overheads

    cal = Calibration({}, 2, recv_s=0.25)
    costs = with_overheads([StageCost(1.0, 1.0) for _ in range(2)], [1, 1], cal)
    r = simulate(build_schedule("gpipe", 2, 1), costs, _links(2))
    # F0, recv (0.25), F1, B1, recv (0.25), B0
    assert r.step_s == pytest.approx(4.5)


def test_delivery_delays_each_message_between_ranks_but_not_a_host_copy():
    # F0 (1) + activation (1 s of bytes + 0.75) + F1 + B1 + gradient (1 + 0.75) + B0
    costs = [StageCost(1.0, 1.0, send_bytes=10**9) for _ in range(2)]
    links = _links(2, bw=1e9)
    links.delivery_s = 0.75
    assert simulate(build_schedule("gpipe", 2, 1), costs, links).step_s == pytest.approx(7.5)
    # stage 0 swaps 8 s of bytes to the host after F0: its B0 waits for the copy back, which
    # no delivery delay lengthens (it is no message between ranks)
    swap = [StageCost(1.0, 1.0, send_bytes=10**9, host_bytes=8 * 10**9), costs[1]]
    links.host_bandwidth = 1e9

    def b0_start(delivery_s):
        links.delivery_s = delivery_s
        r = simulate(build_schedule("gpipe", 2, 1), swap, links)
        return next(st for s, k, mb, st, e in r.timeline if (s, k) == (0, ActionKind.B))

    assert b0_start(0.75) == pytest.approx(b0_start(0.0)) and b0_start(0.0) > 7.5


def test_ranks_sharing_one_core_cannot_beat_their_summed_work():
    # four ranks on one core: k ranks computing at once each run k times slower
    p, m = 4, 8
    costs = [StageCost(1.0, 2.0, step_s=0.5) for _ in range(p)]
    sched = build_schedule("1f1b", p, m)
    alone = simulate(sched, costs, _links(p))
    work = sum(alone.busy_s) + p * 0.5
    assert alone.step_s < 0.6 * work  # without the term: ranks run as if on cores of their own
    shared = simulate(sched, costs, _links(p), slowdown=lambda k: k)
    assert shared.slowdown > 1.5
    assert shared.step_s >= 0.95 * work
    # a host with a core per rank changes nothing
    assert simulate(sched, costs, _links(p), slowdown=lambda k: 1.0).step_s == \
        pytest.approx(alone.step_s)


def test_concurrency_is_what_a_computing_rank_experiences():
    from trainwright.plan.simulate import experienced_concurrency

    # two ranks busy together for 1 s, then one alone for 2 s: the time average over the
    # 3 s is 4/3 ranks, but 2 of the 4 rank-seconds of compute ran two at a time
    timeline = [(0, "F", 0, 0.0, 1.0), (1, "F", 0, 0.0, 3.0), (0, "RECV_F", 1, 1.0, 3.0)]
    assert experienced_concurrency(timeline) == pytest.approx((2 * 2 * 1 + 1 * 1 * 2) / 4)
    assert experienced_concurrency([(0, "SEND_F", 0, 0.0, 1.0)]) == 1.0
    # a GPipe fill and drain: alternating all-busy and few-busy stretches read higher than
    # the time average, which hid the contention the 2-core host measured (issue 32)
    p, m = 4, 4
    costs = [StageCost(1.0, 2.0) for _ in range(p)]
    res = simulate(build_schedule("gpipe", p, m), costs, _links(p))
    assert experienced_concurrency(res.timeline) > sum(res.busy_s) / res.step_s
