"""Schedules are pure data: check them without processes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainwright.errors import PlanError
from trainwright.rebalance.moves import migration_schedule, one_hop_moves
from trainwright.schedule.actions import (
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    Action,
    ActionKind,
    build_schedule,
    format_grid,
    gpipe,
    max_in_flight,
    one_f_one_b,
)
from trainwright.schedule.peer import PeerAction, with_peer_swap


@given(st.integers(1, 6), st.integers(1, 10))
def test_1f1b_holds_at_most_p_minus_i(p, m):
    for i, acts in enumerate(one_f_one_b(p, m)):
        assert max_in_flight(acts) == min(p - i, m)


@given(st.integers(1, 6), st.integers(1, 10))
def test_gpipe_holds_all_microbatches(p, m):
    assert all(max_in_flight(acts) == m for acts in gpipe(p, m))


@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 10))
def test_every_microbatch_once_and_sends_match_receives(name, p, m):
    sched = build_schedule(name, p, m)
    for s, acts in enumerate(sched):
        for kind in (ActionKind.F, ActionKind.B):
            assert sorted(a.mb for a in acts if a.kind == kind) == list(range(m))
        assert [a.kind for a in acts[-2:]] == [ActionKind.SYNC, ActionKind.STEP]
        if s + 1 < p:  # what s sends forward, s+1 receives in the same order, and back
            nxt = sched[s + 1]
            assert [a.mb for a in acts if a.kind == ActionKind.SEND_F] == \
                [a.mb for a in nxt if a.kind == ActionKind.RECV_F]
            assert [a.mb for a in nxt if a.kind == ActionKind.SEND_B] == \
                [a.mb for a in acts if a.kind == ActionKind.RECV_B]
    format_grid(sched)  # raises if the dry run deadlocks


def test_grid_and_notation():
    sched = one_f_one_b(2, 2)
    compute = [str(a) for a in sched[1] if a.kind in (ActionKind.F, ActionKind.B)]
    assert compute == ["1F0", "1B0", "1F1", "1B1"]
    grid = format_grid(sched).splitlines()
    assert grid[0].split() == ["step", "s0", "s1"]
    assert grid[1].split() == ["0", "F0", "."]


def test_bad_schedule_names_the_choices():
    with pytest.raises(PlanError, match="1f1b"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(PlanError):
        gpipe(0, 4)


def _every_list() -> list[list[Action]]:
    """Action lists of every generator, with a migration and a peer swap woven in."""
    out = []
    for name in SCHEDULES:
        sched = build_schedule(name, 3, 4)
        moves, _ = one_hop_moves([2, 2, 2], [3, 2, 1])
        out += sched + migration_schedule(sched, moves, 1).actions
        out += with_peer_swap(sched, {0: [1, 2], 1: [2]})
    for name in VIRTUAL_SCHEDULES:
        out += build_schedule(name, 2, 4, virtual_stages=2)
    return out


def test_every_emitted_kind_is_an_action_kind():
    lists = _every_list()
    kinds = {type(a.kind) for acts in lists for a in acts}
    assert kinds == {ActionKind}
    seen = {a.kind for acts in lists for a in acts}
    assert seen == set(ActionKind)  # the enum holds nothing no schedule emits


def test_action_prints_as_before():
    """The notation (and so the grid, CSV, trace names and reports) stays byte-identical."""
    assert str(Action(1, ActionKind.F, 0)) == "1F0"
    assert str(Action(0, "RECV_B", 12)) == "0RECV_B12"
    assert str(Action(2, ActionKind.SYNC)) == "2SYNC"
    assert str(Action(0, ActionKind.MIG_SEND, 1)) == "0MIG_SEND1"
    assert str(PeerAction(1, ActionKind.PEER_RETURN, 3, 2)) == "1PEER_RETURN3@2"
    kind = ActionKind.SEND_F
    assert f"{kind}" == str(kind) == kind == "SEND_F" and hash(kind) == hash("SEND_F")


def test_action_converts_a_string_kind_and_names_the_known_ones():
    a = Action(0, "W", 3)
    assert a.kind is ActionKind.W
    assert a == Action(0, ActionKind.W, 3)
    with pytest.raises(ValueError, match=r"unknown action kind 'X'.*MIG_SEND.*PEER_SETTLE"):
        Action(0, "X", 0)
