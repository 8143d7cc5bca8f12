"""Imbalance detection: noise does not trigger it, a lasting imbalance does, once."""

import random

import pytest

from trainwright.rebalance.detect import ImbalanceDetector

pytestmark = pytest.mark.timeout(60)


def test_noise_within_threshold_never_triggers():
    rng = random.Random(0)
    det = ImbalanceDetector(threshold_rel=0.1)
    # +-4 % noise around balanced stages: smoothed spread stays well under 10 %
    assert not any(det.observe([1.0 + rng.uniform(-0.04, 0.04) for _ in range(4)])
                   for _ in range(500))


def test_single_spike_is_absorbed_by_smoothing_and_patience():
    det = ImbalanceDetector(threshold_rel=0.1, smoothing=0.3, patience=3)
    for _ in range(10):
        assert not det.observe([1.0, 1.0])
    assert not det.observe([3.0, 1.0])  # one slow step (a GC pause, a noisy neighbour)
    assert not any(det.observe([1.0, 1.0]) for _ in range(20))


def test_lasting_imbalance_triggers_after_patience_then_waits_for_the_fix():
    det = ImbalanceDetector(threshold_rel=0.1, smoothing=1.0, patience=3, cooldown=4)
    seen = [det.observe([2.0, 1.0]) for _ in range(3)]
    assert seen == [False, False, True]
    assert det.imbalance == pytest.approx(0.5)
    # until the caller re-partitions, the quiet period stops a second decision
    assert not any(det.observe([2.0, 1.0]) for _ in range(4))
    det.repartitioned()
    assert not any(det.observe([1.0, 1.02]) for _ in range(10))  # balanced now


def test_no_decision_while_migrating_or_cooling_down():
    det = ImbalanceDetector(threshold_rel=0.1, smoothing=1.0, patience=1, cooldown=2)
    assert not det.observe([5.0, 1.0], migrating=True)
    det.repartitioned()
    assert [det.observe([5.0, 1.0]) for _ in range(3)] == [False, False, True]


def test_absolute_threshold_and_bad_settings():
    det = ImbalanceDetector(threshold_rel=None, threshold_s=0.5, smoothing=1.0, patience=1)
    assert not det.observe([1.4, 1.0])
    assert det.observe([1.6, 1.0])
    with pytest.raises(ValueError):
        ImbalanceDetector(threshold_rel=None, threshold_s=None)
    with pytest.raises(ValueError):
        ImbalanceDetector(smoothing=0)
