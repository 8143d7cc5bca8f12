"""`trainwright bench planner` runs end to end (tiny sizes) and its byte predictions hold."""

from __future__ import annotations

import statistics

import pytest

from trainwright.bench.forecast_model import ForecastSpec
from trainwright.bench.planner import PlannerBenchSpec, dgx1_table, plan_175b, run


@pytest.mark.slow  # calibration, 6 `trainwright run` subprocesses + the families: ~3 min idle
@pytest.mark.timeout(900)
def test_bench_planner_forecast_runs_and_keys_come_from_its_rows(tmp_path):
    spec = PlannerBenchSpec(n_blocks=2, d_model=32, n_heads=2, context=16, vocab=64,
                            micro_batches=4, micro_batch_size=2, steps=3, warmup=1,
                            stage_counts=[2], schedules=["1f1b"])
    forecast = ForecastSpec(n_blocks=2, d_model=32, n_heads=2, context=16,
                            micro_batch_size=2, steps=3, warmup=1, repeats=2,
                            profile_repeats=2, calibration=str(tmp_path / "cal.json"),
                            configs=[[2, 4, "gpipe", "keep"], [2, 2, "interleaved-1f1b",
                                                                "recompute"],
                                     [2, 4, "1f1b", "limit80"]])
    r = run(spec, repeats=1, big=False, forecast=forecast)
    rows = r["configs"]
    assert [(c["pp"], c["schedule"], c["policy"]) for c in rows] == [
        (2, "gpipe", "keep"), (2, "interleaved-1f1b", "recompute"), (2, "1f1b", "limit80")]
    cal = r["calibration"]
    assert (tmp_path / "cal.json").exists() and cal["slowdown"]["1"] == 1.0
    assert set(cal["slowdown"]) == {"1", "2"} and cal["host"] == r["host"]
    # three takes between the profile's, each term their median
    assert cal["recv_s"] == statistics.median(t["recv_s"] for t in r["calibration_takes"])
    assert len(r["calibration_takes"]) == 3
    errs = []
    for c in rows:
        assert len(c["measured_step_s_per_round"]) == 2
        err = abs(c["predicted_step_s"] - c["measured_step_s"]) / c["measured_step_s"]
        assert c["step_error"] == pytest.approx(err, abs=1e-3)
        errs.append(err)
        peak = max(abs(p - m) / m for p, m in zip(c["predicted_peak_bytes"],
                                                  c["metered_peak_bytes"], strict=True))
        assert c["peak_error_max"] == pytest.approx(peak, abs=1e-3)
        # the store's own accounting is what the simulator models: bytes are deterministic
        # (a host-swapped layer's bytes the store counts apart: the footprint model's part)
        if "swap" not in c.get("planned_policies", [c["policy"]]):
            assert c["peak_error_vs_store_max"] <= 0.05
        # the calibration's terms only add time
        assert c["predicted_step_s"] >= c["predicted_step_s_uncalibrated"]
    limited = rows[2]
    assert len(limited["planned_policies"]) == 4 and len(limited["limit_bytes"]) == 2
    assert limited["over_limit"] == [f and m > lim for f, m, lim in zip(
        limited["planned_fits"], limited["metered_peak_bytes"], limited["limit_bytes"],
        strict=True)]
    assert r["planned_stages"] == sum(limited["planned_fits"])
    assert r["plans_over_limit"] == sum(limited["over_limit"])
    assert r["predict_step_error_max"] == pytest.approx(max(errs), abs=1e-3)
    assert r["predict_step_error_median"] == pytest.approx(statistics.median(errs), abs=1e-3)
    # ranked by samples/s: the rows train 8, 4 and 8 samples per step
    best = max(rows, key=lambda c: c["micro_batches"] * 2 / c["predicted_step_s"])
    assert r["best_predicted_vs_best_measured"] == pytest.approx(
        max(c["micro_batches"] * 2 / c["measured_step_s"] for c in rows)
        / (best["micro_batches"] * 2 / best["measured_step_s"]), rel=1e-3)
    v = r["verdicts"]
    assert v["predict_step_error_max"]["verdict"] == (
        "met" if r["predict_step_error_max"] <= 0.15 else "missed")
    assert v["planned_stages"]["verdict"] == "missed"  # 2 stages planned, the target is 40
    assert len(r["paired_ratios"]) == 2 and "ratio_spread" in r and r["host"]["cpus"] >= 1
    probes = r["contention"]["2"]  # each contention run's rounds, and their median fitted
    assert [len(t) for t in probes["measured_step_s_per_round"]] == [2] * len(probes["configs"])
    assert probes["measured_step_s"] == pytest.approx(
        [statistics.median(t) for t in probes["measured_step_s_per_round"]], abs=1e-5)
    # the all-swap run's copies over the profile's, per round; their median is the term
    assert len(probes["copy_ratio_per_round"]) == 2 and r["profile"]["copy_cpu_s_per_byte"] > 0
    assert probes["copy_inflation"] == pytest.approx(
        statistics.median(probes["copy_ratio_per_round"]), rel=1e-3)
    assert "copy_inflation_fitted" in probes
    assert r["profile"]["latency_s"] > 0 and len(r["profile"]["layers"]) == 4
    fams = r["families"]
    assert fams["host"]["fits"] and fams["recompute"]["fits"]
    assert len(r["peer_vs_best_other_paired_ratios"]) == 1


@pytest.mark.timeout(300)
def test_175b_on_1024_gpus_plans_and_dgx1_table():
    got = plan_175b()
    assert got["fits"] and got["pp"] * got["dp"] == 1024 and got["predicted_step_s"] > 0
    rows = dgx1_table()
    assert [r["peer_swap"] for r in rows] == [False, True]
    assert all(all(r["fits"]) for r in rows)


def test_the_forecasts_profile_is_the_median_of_its_takes():
    from trainwright.bench.forecast_model import Profile, merged
    from trainwright.observe.tensor_profile import LayerTensors

    def take(ms: float, table: str) -> Profile:
        rows = [LayerTensors(i, f"l{i}", ms / 1e3, 2 * ms / 1e3, 8, 8, 8, weight_s=ms / 1e3)
                for i in range(2)]
        return Profile(rows, [ms / 1e4] * 2, 1e-4, 1e9, 1e10, 1.0, table)

    # the second take ran in a slow phase: the median ignores it
    got = merged([take(1.0, "a"), take(1.4, "b"), take(1.1, "c")])
    assert [r.forward_s for r in got.rows] == [pytest.approx(1.1e-3)] * 2
    assert [r.backward_s for r in got.rows] == [pytest.approx(2.2e-3)] * 2
    assert got.opt_step_s == [pytest.approx(1.1e-4)] * 2 and got.table == "c"
    assert got.takes_ms == [6.0, 8.4, 6.6] and got.wall_s == 3.0
