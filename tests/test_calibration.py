"""The step-time calibration's fits, from injected timings (no clock is read here)."""

from __future__ import annotations

import pytest

from trainwright.errors import PlanError
from trainwright.plan.calibration import (
    Calibration,
    fit_overhead,
    fit_slowdown,
    load,
    save,
    scaled,
    with_overheads,
)
from trainwright.plan.simulate import StageCost
from trainwright.schedule.base import ActionKind

HOST = {"cpu_model": "test cpu", "cpus": 2, "platform": "linux", "torch": "2.13.0+cpu"}


def test_fit_overhead_recovers_action_and_segment_terms():
    # action 30 us + 5 us per segment on top of what the profile saw (1 and 4 layers)
    profiled = {1: 100e-6, 4: 400e-6}
    timed = {n: [profiled[n] + 30e-6 + n * 5e-6 + d for d in (-1e-6, 0.0, 2e-6)]
             for n in (1, 4)}
    action, segment = fit_overhead(timed, profiled)
    assert action == pytest.approx(30e-6, abs=1e-9)
    assert segment == pytest.approx(5e-6, abs=1e-9)


def test_fit_overhead_clamps_noise_below_zero_and_needs_two_counts():
    action, segment = fit_overhead({1: [0.9], 4: [3.5]}, {1: 1.0, 4: 4.0})
    assert action == 0.0 and segment == 0.0
    with pytest.raises(PlanError, match="two or more segment counts"):
        fit_overhead({1: [1.0]}, {1: 1.0})


def test_fit_slowdown_is_relative_to_one_rank_alone():
    got = fit_slowdown({1: [1.0, 1.2, 1.1], 2: [1.1, 1.1, 1.1], 4: [2.2, 2.3, 2.1]})
    assert got == {1: 1.0, 2: pytest.approx(1.0), 4: pytest.approx(2.0)}
    with pytest.raises(PlanError, match="one rank alone"):
        fit_slowdown({2: [1.0]})


def test_factor_interpolates_and_extends_past_the_largest_count():
    cal = Calibration(HOST, 2, slowdown={1: 1.0, 2: 1.0, 4: 2.0})
    assert cal.factor(0.5) == 1.0
    assert cal.factor(3) == pytest.approx(1.5)
    assert cal.factor(6) == pytest.approx(3.0)


def test_with_overheads_charges_every_action_kind():
    cal = Calibration(HOST, 2, action_s=1e-3, segment_s=2e-4, send_s=3e-5, recv_s=4e-4)
    c = StageCost(1.0, 2.0, action_s={ActionKind.PEER_RECV: 0.5})
    (got,) = with_overheads([c], [3], cal)
    assert got.action_s[ActionKind.F] == pytest.approx(1e-3 + 3 * 2e-4)
    assert got.action_s[ActionKind.W] == pytest.approx(1e-3 + 3 * 2e-4)
    assert got.action_s[ActionKind.SEND_B] == 3e-5
    assert got.action_s[ActionKind.RECV_F] == 4e-4
    assert got.action_s[ActionKind.PEER_RECV] == 0.5
    assert c.action_s == {ActionKind.PEER_RECV: 0.5}  # the input is not changed


def test_scaled_multiplies_cpu_work_only():
    c = StageCost(1.0, 2.0, weight_s=0.5, step_s=0.25, send_bytes=100, held_bytes=7,
                  action_s={ActionKind.F: 0.1}, layer_forward_s=[0.5, 0.5])
    (got,) = scaled([c], 2.0)
    assert (got.forward_s, got.backward_s, got.weight_s, got.step_s) == (2.0, 4.0, 1.0, 0.5)
    assert got.action_s[ActionKind.F] == 0.2 and got.layer_forward_s == [1.0, 1.0]
    assert (got.send_bytes, got.held_bytes) == (100, 7)


def test_cache_is_used_only_on_the_host_it_was_measured_on(tmp_path):
    cal = Calibration(HOST, 2, action_s=1e-5, slowdown={1: 1.0, 3: 1.6})
    path = tmp_path / "sub" / "calibration.json"
    save(path, cal)
    assert load(path, HOST) == cal
    assert load(path, {**HOST, "cpus": 16}) is None
    assert load(tmp_path / "missing.json", HOST) is None
