"""The paired-round helpers every benchmark uses."""

import pytest

from trainwright.bench import paired


def test_balanced_rounds_are_even_so_each_system_runs_first_as_often_as_last():
    assert [paired.balanced_rounds(n) for n in (1, 2, 5, 6)] == [2, 2, 6, 6]
    firsts = [paired.round_order(["a", "b"], r)[0] for r in range(paired.balanced_rounds(5))]
    assert firsts.count("a") == firsts.count("b")


def test_round_order_alternates():
    assert paired.round_order(["a", "b"], 0) == ["a", "b"]
    assert paired.round_order(["a", "b"], 1) == ["b", "a"]
    assert paired.round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_paired_ratio_is_median_of_per_round_ratios():
    out = paired.paired([2.0, 3.0, 8.0], [1.0, 2.0, 2.0])
    assert out["paired_ratios"] == [2.0, 1.5, 4.0]
    assert out["ratio"] == 2.0
    assert out["ratio_spread"]["min"] == 1.5 and out["ratio_spread"]["max"] == 4.0
    assert out["ratio_spread"]["relative_half_range"] == pytest.approx(0.625)


def test_paired_refuses_unequal_rounds():
    with pytest.raises(ValueError, match="one figure per round"):
        paired.paired([1.0], [1.0, 2.0])


def test_host_info_names_cpu_and_versions():
    info = paired.host_info()
    assert info["cpus"] >= 1 and info["torch"] and info["cpu_model"]
