"""Schedules are pure data: check them without processes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainwright.errors import PlanError
from trainwright.schedule.actions import (
    build_schedule,
    format_grid,
    gpipe,
    max_in_flight,
    one_f_one_b,
)


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
        for kind in ("F", "B"):
            assert sorted(a.mb for a in acts if a.kind == kind) == list(range(m))
        assert [a.kind for a in acts[-2:]] == ["SYNC", "STEP"]
        if s + 1 < p:  # what s sends forward, s+1 receives in the same order, and back
            nxt = sched[s + 1]
            assert [a.mb for a in acts if a.kind == "SEND_F"] == \
                [a.mb for a in nxt if a.kind == "RECV_F"]
            assert [a.mb for a in nxt if a.kind == "SEND_B"] == \
                [a.mb for a in acts if a.kind == "RECV_B"]
    format_grid(sched)  # raises if the dry run deadlocks


def test_grid_and_notation():
    sched = one_f_one_b(2, 2)
    assert [str(a) for a in sched[1] if a.kind in ("F", "B")] == ["1F0", "1B0", "1F1", "1B1"]
    grid = format_grid(sched).splitlines()
    assert grid[0].split() == ["step", "s0", "s1"]
    assert grid[1].split() == ["0", "F0", "."]


def test_bad_schedule_names_the_choices():
    with pytest.raises(PlanError, match="1f1b"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(PlanError):
        gpipe(0, 4)
