"""The step-time calibration's fits, from injected timings (no clock is read here), and
the planner's use of an injected calibration (``trainwright plan --topology cpu``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainwright.errors import PlanError
from trainwright.observe.tensor_profile import LayerTensors, SavedTensor
from trainwright.plan.calibration import (
    Calibration,
    count_segments,
    fit_delivery,
    fit_increasing,
    fit_overhead,
    fit_slowdown,
    fit_transport,
    load,
    save,
    scaled,
    with_delivery,
    with_overheads,
)
from trainwright.plan.candidates import (
    bytes_per_param,
    enumerate_candidates,
    rank_candidates,
    scaled_layers,
)
from trainwright.plan.devices import DeviceTopology
from trainwright.plan.planner import PlanRequest, make_plan, sharing_of, slowdown_of
from trainwright.plan.sharing import Sharing
from trainwright.plan.simulate import Links, StageCost
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


def test_fit_delivery_is_the_mean_beyond_what_the_link_and_receive_already_charge():
    # a heavy tail (a scheduler tick) is most of the sum: the mean, not the median
    delays = {2: [0.5e-3, 0.5e-3, 0.5e-3, 4.5e-3], 4: [3e-3, 3e-3], 3: []}
    got = fit_delivery(delays, plain_s=0.2e-3, recv_s=0.1e-3)
    assert got == {2: pytest.approx(1.5e-3 - 0.3e-3), 4: pytest.approx(3e-3 - 0.3e-3)}
    assert fit_delivery({2: [0.1e-3]}, 0.2e-3, 0.1e-3) == {2: 0.0}  # noise is no speed-up


def test_delivery_interpolates_between_chains_and_holds_past_them():
    cal = Calibration(HOST, 2, delivery_s={2: 1e-3, 4: 3e-3})
    assert cal.delivery(1) == 0.0  # one rank sends no message
    assert cal.delivery(2) == pytest.approx(1e-3)
    assert cal.delivery(3) == pytest.approx(2e-3)
    assert cal.delivery(16) == pytest.approx(3e-3)  # the longest chain's, not a line's
    assert Calibration(HOST, 2).delivery(4) == 0.0  # not measured: no extra
    links = Links([0, 1], [[0.0, 1e9], [1e9, 0.0]], latency_s=1e-5)
    assert with_delivery(links, cal, 3).delivery_s == pytest.approx(2e-3)
    assert with_delivery(links, None, 3) is links and links.delivery_s == 0.0


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
    cal = Calibration(HOST, 2, action_s=1e-5, slowdown={1: 1.0, 3: 1.6},
                      delivery_s={2: 1e-3, 3: 2e-3})
    path = tmp_path / "sub" / "calibration.json"
    save(path, cal)
    assert load(path, HOST) == cal
    assert load(path, {**HOST, "cpus": 16}) is None
    assert load(tmp_path / "missing.json", HOST) is None
    # measured by an older method (single short units: shared cores looked free; no
    # delivery chain): again
    old = {k: v for k, v in cal.to_dict().items() if k != "method"}
    path.write_text(json.dumps(old))
    assert load(path, HOST) is None
    path.write_text(json.dumps({**old, "method": 2}))
    assert load(path, HOST) is None


def test_segments_count_runs_of_kept_layers_and_every_other_layer():
    assert count_segments([0, 1, 2, 3], {}) == 1
    assert count_segments([0, 1, 2, 3], {1: "recompute"}) == 3
    assert count_segments([4, 5], {4: "swap", 5: "swap"}) == 2


def _gpt_like_rows(n: int = 6) -> list:
    """One sample's rows of ``n`` equal layers (embedding, blocks, head of a tiny GPT)."""
    return [LayerTensors(i, f"l{i}", 1e-3, 2e-3, input_bytes=4096, output_bytes=4096,
                         param_bytes=1000, tensors=[SavedTensor(0, 4096, [1024], "float32")])
            for i in range(n)]


def _cpu2() -> DeviceTopology:
    """Two ranks on this host's cores (the ``cpu`` preset's links)."""
    return DeviceTopology("cpu2", [2**31] * 2, [[0.0, 2.6e9], [2.6e9, 0.0]], [5.4e9] * 2,
                          kind="cpu")


def _ranked(cal: Calibration | None) -> dict[str, float]:
    rows, per = _gpt_like_rows(), bytes_per_param(4, "sgd")
    cands, _ = enumerate_candidates(2, 2, len(rows), 32, [1, 2])
    base = PlanRequest(rows, "1f1b", 2, 1, _cpu2(), state_factor=per.total / 4,
                       latency_s=1e-5, calibration=cal)
    outs = rank_candidates(cands, {k: scaled_layers(rows, k) for k in (1, 2)}, base, per, 4)
    return {o.candidate.label(): o.step_s for o in outs}


M16, M8 = "pp1 x dp2 1f1b m=16 (mbs 1)", "pp1 x dp2 1f1b m=8 (mbs 2)"


def test_calibrated_overhead_ranks_fewer_larger_micro_batches_first():
    # 32 samples on 2 replicas: 16 micro-batches of 1 or 8 of 2 do the same compute; only
    # the per-action overhead tells them apart (issue 33: the uncalibrated plan picked
    # m=16, which ran 1.27x slower than m=8 on a 2-core host)
    plain = _ranked(None)
    assert plain[M16] == pytest.approx(plain[M8], rel=1e-9)  # no preference without it
    cal = Calibration(HOST, 2, action_s=5e-3, slowdown={1: 1.0, 2: 1.0})
    got = _ranked(cal)
    assert next(iter(got)) == M8, got  # the pick
    # m=16 runs 16 more F/B actions per rank, each paying 5 ms
    assert got[M16] - got[M8] == pytest.approx(16 * 5e-3, rel=1e-6)
    assert got[M8] == pytest.approx(plain[M8] + 16 * 5e-3, rel=1e-6)


def test_shared_core_slowdown_counts_every_replica():
    rows = _gpt_like_rows()
    cal = Calibration(HOST, 2, slowdown={1: 1.0, 2: 2.0, 4: 3.0})
    req = PlanRequest(rows, "1f1b", 1, 4, _cpu2(), peer_swap=False)
    alone = make_plan(req).sim.step_s
    one = make_plan(replace(req, calibration=cal)).sim
    two = make_plan(replace(req, calibration=cal, replicas=2)).sim
    assert one.step_s == pytest.approx(alone) and one.slowdown == pytest.approx(1.0)
    # one rank per replica, two replicas computing at once: factor(2)
    assert two.step_s == pytest.approx(2.0 * alone) and two.slowdown == pytest.approx(2.0)
    assert slowdown_of(replace(req, calibration=cal, replicas=2))(1.5) == cal.factor(3)
    assert slowdown_of(req) is None
    # in the ranking: a dp2 candidate is planned with its 2 replicas (its few-microsecond
    # gradient sync is not scaled)
    ranked = _ranked(cal)
    assert ranked[M8] == pytest.approx(2.0 * _ranked(None)[M8], rel=1e-4)


def test_planned_costs_carry_one_fused_segment_per_kept_stage():
    rows = _gpt_like_rows()
    cal = Calibration(HOST, 2, action_s=1e-3, segment_s=1e-4, send_s=2e-5, recv_s=3e-5)
    req = PlanRequest(rows, "1f1b", 2, 4, _cpu2(), peer_swap=False, calibration=cal)
    plan = make_plan(req)
    for c in plan.costs:  # every layer kept: one segment per action
        assert c.action_s[ActionKind.F] == pytest.approx(1e-3 + 1e-4)
        assert c.action_s[ActionKind.SEND_F] == pytest.approx(2e-5)
    plain = make_plan(replace(req, calibration=None))
    assert all(not c.action_s for c in plain.costs)
    assert plan.sim.step_s > plain.sim.step_s + 2 * 4 * 1e-3


def test_sharing_needs_the_transport_measured_and_carries_the_models_inflation():
    assert Calibration(HOST, 2).sharing() is None
    cal = Calibration(HOST, 2, transport_s=4e-4, transport_s_per_byte=1e-9)
    assert cal.sharing(1.2) == Sharing(2, 4e-4, 1e-9, 1.2)
    assert cal.sharing(1.2, 1.7) == Sharing(2, 4e-4, 1e-9, 1.2, copy_inflation=1.7)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_with_the_transport_measured_delivery_is_a_chain_within_the_cores():
    """The processor-sharing replay models what longer chains add (ranks waiting for a
    core); the wake-up of a waiting rank stays."""
    links = Links([0, 1], [[0.0, 1e9], [1e9, 0.0]])
    chains = {2: 1e-3, 4: 3e-3}
    assert with_delivery(links, Calibration(HOST, 2, delivery_s=chains), 4).delivery_s == 3e-3
    cal = Calibration(HOST, 2, delivery_s=chains, transport_s=4e-4)
    assert with_delivery(links, cal, 4).delivery_s == 1e-3


def test_fit_increasing_finds_the_measured_value_and_holds_at_the_bounds():
    assert fit_increasing(lambda x: 2 * x + 1, 4.0, 0.0, 10.0) == pytest.approx(1.5)
    assert fit_increasing(lambda x: 2 * x + 1, 0.5, 0.0, 10.0) == 0.0
    assert fit_increasing(lambda x: 2 * x + 1, 99.0, 0.0, 10.0) == 10.0


def test_a_plan_on_shared_cores_takes_its_time_from_the_sharing_replay():
    rows = _gpt_like_rows()
    req = PlanRequest(rows, "1f1b", 2, 4, _cpu2(), peer_swap=False)
    assert sharing_of(req) is None
    cal = Calibration(HOST, 2, transport_s=1e-3)
    alone = make_plan(replace(req, calibration=cal)).sim
    two = make_plan(replace(req, calibration=cal, replicas=2)).sim
    assert sharing_of(replace(req, calibration=cal, replicas=2)).cores == 1.0
    # two replicas on the host's two cores: each pipeline has one core for its two ranks
    assert two.step_s > alone.step_s


def test_fit_transport_is_a_line_through_the_two_sizes_never_below_zero():
    a, b = fit_transport({1024: 7e-4, 263168: 8e-4})
    assert b == pytest.approx(1e-4 / (263168 - 1024))
    assert a + 1024 * b == pytest.approx(7e-4)
    assert fit_transport({1024: 8e-4, 262144: 7e-4}) == (8e-4, 0.0)  # noise: not cheaper
    with pytest.raises(PlanError, match="two message sizes"):
        fit_transport({1024: 8e-4})


def test_takes_merge_term_by_term_so_one_slow_take_moves_nothing():
    def take(recv, slow4, transport, host="h"):
        return Calibration({"cpu": host}, 2, action_s=1e-5, segment_s=2e-5, send_s=1e-4,
                           recv_s=recv, slowdown={1: 1.0, 2: 1.1, 4: slow4},
                           delivery_s={2: 1e-3}, transport_s=transport)

    got = Calibration.median_of([take(1.2e-3, 2.0, 7e-4), take(1.1e-4, 2.2, None),
                                 take(1.3e-4, 2.1, 8e-4, host="last")])
    assert got.recv_s == 1.3e-4 and got.slowdown == {1: 1.0, 2: 1.1, 4: 2.1}
    assert got.transport_s == pytest.approx(7.5e-4)  # of the takes that measured it
    assert got.host == {"cpu": "last"} and got.send_s == 1e-4 and got.delivery_s == {2: 1e-3}
    one = take(1e-4, 2.0, None)
    assert Calibration.median_of([one]) == one
    with pytest.raises(ValueError):
        Calibration.median_of([])
