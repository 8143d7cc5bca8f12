"""The processor-sharing replay (ranks sharing the host's cores), against hand-computed
steps and against the plain replay where nothing is shared."""

import math

import pytest

from trainwright.errors import PlanError
from trainwright.plan.sharing import Sharing, replay, supported
from trainwright.plan.simulate import Links, StageCost, simulate
from trainwright.schedule.actions import build_schedule
from trainwright.schedule.base import Action, ActionKind
from trainwright.schedule.carry import simulated_lists

F, B = ActionKind.F, ActionKind.B
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F


def _links(n: int, latency: float = 0.0) -> Links:
    return Links(list(range(n)), [[math.inf] * n for _ in range(n)], latency_s=latency)


def test_two_ranks_on_one_core_each_run_at_half_speed():
    lists = [[Action(0, F, 0)], [Action(1, F, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=0.0)] * 2
    assert replay(lists, costs, _links(2), Sharing(cores=1)).step_s == pytest.approx(2.0)
    assert replay(lists, costs, _links(2), Sharing(cores=2)).step_s == pytest.approx(1.0)


def test_a_message_costs_transport_cpu_at_both_ends_and_shares_the_core():
    """Rank 0: F0 (1 s), send, F1 (1 s); rank 1: receive, F0 (1 s); one core, 0.1 s of
    transport CPU at each end, 0.5 s of link. By hand: F0 ends at 1.0; the sender's
    transport shares the core with F1 (0.2 s wall, F1 has 0.9 s left at 1.2); the link
    until 1.7 (F1 alone: 0.4 left); the receiver's transport shares with F1 until 1.9
    (F1: 0.3 left); rank 1's F0 shares with F1 until 2.5, then runs alone: 0.7 s, ends 3.2."""
    lists = [[Action(0, F, 0), Action(0, SEND_F, 0), Action(0, F, 1)],
             [Action(1, RECV_F, 0), Action(1, F, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=0.0, send_bytes=8)] * 2
    got = replay(lists, costs, _links(2, latency=0.5), Sharing(cores=1, transport_s=0.1))
    assert got.step_s == pytest.approx(3.2)
    ends = {(s, k, mb): e for s, k, mb, _, e in got.timeline}
    assert ends[(0, F, 1)] == pytest.approx(2.5)
    assert ends[(1, RECV_F, 0)] == pytest.approx(1.9)


def test_transport_cpu_grows_with_the_bytes():
    lists = [[Action(0, SEND_F, 0)], [Action(1, RECV_F, 0)]]
    costs = [StageCost(forward_s=0.0, backward_s=0.0, send_bytes=1000)] * 2
    got = replay(lists, costs, _links(2), Sharing(cores=2, transport_s=0.1,
                                                  transport_s_per_byte=1e-4))
    assert got.step_s == pytest.approx(2 * (0.1 + 0.1))


def test_inflation_scales_compute_not_overheads():
    lists = [[Action(0, F, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=0.0, action_s={F: 0.5})]
    got = replay(lists, costs, _links(1), Sharing(cores=1, inflation=1.5))
    assert got.step_s == pytest.approx(1.5 + 0.5)


def test_host_copies_are_cpu_work_of_the_rank():
    lists = [[Action(0, F, 0), Action(0, B, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=2.0, host_bytes=100)]
    links = Links([0], [[math.inf]], host_bandwidth=200.0)
    assert replay(lists, costs, links, Sharing(cores=1)).step_s == pytest.approx(3.0 + 1.0)


def test_copy_inflation_scales_the_host_copies_alone():
    lists = [[Action(0, F, 0), Action(0, B, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=2.0, host_bytes=100)]
    links = Links([0], [[math.inf]], host_bandwidth=200.0)
    got = replay(lists, costs, links, Sharing(cores=1, inflation=1.5, copy_inflation=3.0))
    assert got.step_s == pytest.approx(1.5 * 3.0 + 3.0 * 1.0)


@pytest.mark.parametrize("schedule,pp,v", [("gpipe", 2, 1), ("1f1b", 4, 1), ("zb-h1", 3, 1),
                                           ("interleaved-1f1b", 2, 2), ("zb-v", 2, 2)])
def test_with_cores_to_spare_it_is_the_plain_replay(schedule, pp, v):
    """Every rank has a core, messages cost nothing: the same step as the plain replay
    (uneven stages, so that ranks wait on each other). Sends cost nothing here: a message
    leaves when its posting ends, where the plain replay sends it when the posting starts."""
    lists = simulated_lists(schedule, build_schedule(schedule, pp, 4, v))
    costs = [StageCost(forward_s=0.01 * (1 + s % 3), backward_s=0.02 * (1 + s % 2),
                       weight_s=0.008, step_s=0.003, send_bytes=64,
                       action_s={ActionKind.F: 1e-4, ActionKind.B: 2e-4})
             for s in range(pp * v)]
    plain = simulate(lists, costs, _links(pp))
    shared = simulate(lists, costs, _links(pp), sharing=Sharing(cores=64))
    assert shared.step_s == pytest.approx(plain.step_s)
    assert shared.peak_bytes == plain.peak_bytes


def test_fewer_cores_than_ranks_makes_a_step_longer_and_says_by_how_much():
    lists = simulated_lists("1f1b", build_schedule("1f1b", 4, 8, 1))
    costs = [StageCost(forward_s=0.01, backward_s=0.02, send_bytes=64)] * 4
    plain = simulate(lists, costs, _links(4))
    shared = simulate(lists, costs, _links(4), sharing=Sharing(cores=2, transport_s=1e-4))
    assert shared.step_s > plain.step_s
    assert shared.slowdown == pytest.approx(shared.step_s / plain.step_s)
    # no faster than the CPU work allows: every rank's compute and the messages on 2 cores
    work = 8 * 4 * 0.03 + 2 * 1e-4 * 8 * 2 * 3
    assert shared.step_s >= work / 2


def test_a_receive_never_sent_is_a_deadlock():
    lists = [[Action(0, RECV_F, 0)], [Action(1, F, 0)]]
    costs = [StageCost(forward_s=1.0, backward_s=0.0)] * 2
    with pytest.raises(PlanError, match="deadlocks"):
        replay(lists, costs, _links(2), Sharing(cores=2))


def test_peer_swap_is_left_to_the_plain_replay():
    lists = [[Action(0, F, 0), Action(0, ActionKind.PEER_WAIT, 0)]]
    assert not supported(lists)
    with pytest.raises(PlanError, match="peer swap"):
        replay(lists, [StageCost(forward_s=1.0, backward_s=0.0)], _links(1), Sharing(cores=1))


def test_no_cores_is_refused():
    with pytest.raises(PlanError, match="cores"):
        replay([[Action(0, F, 0)]], [StageCost(forward_s=1.0, backward_s=0.0)], _links(1),
               Sharing(cores=0))
