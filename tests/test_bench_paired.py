"""The paired-round helpers every benchmark uses."""

from pathlib import Path

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


def test_host_info_tells_apart_cpus_that_share_a_model_name():
    # a VM's CPU reads "AMD EPYC" whatever its generation: family, model and stepping do not
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "cpu family" not in cpuinfo.read_text():
        pytest.skip("no /proc/cpuinfo with a cpu family here")
    first = cpuinfo.read_text().split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, v in
              (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    want = f"family {fields['cpu family']} model {fields['model']} stepping {fields['stepping']}"
    assert paired.host_info()["cpu_id"] == want


def test_interval_is_the_range_of_few_rounds_and_a_bootstrap_of_many():
    assert paired.interval([1.2, 0.9, 1.0]) == (0.9, 1.2)
    many = [1.00, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.00]
    lo, hi = paired.interval(many)
    assert 0.97 <= lo < 1.0 < hi <= 1.03
    assert paired.interval(many) == (lo, hi)  # seeded: the same JSON twice


def test_verdict_is_decided_by_the_far_end_not_the_median():
    # median 1.0 clears a <= 1.05 target, but one round at 1.2 keeps the interval over it
    rounds = [1.0, 1.0, 1.2]
    block = paired.judged(rounds, 1.05)
    assert block["median"] == 1.0 and block["interval"] == [1.0, 1.2]
    assert block["verdict"] == "missed"
    assert paired.judged([0.9, 0.95, 1.0], 1.05)["verdict"] == "met"
    # an at-least target is judged on the low end
    assert paired.verdict((0.85, 1.3), 0.9, at_most=False) == "missed"
    assert paired.verdict((0.91, 1.3), 0.9, at_most=False) == "met"
