"""The forecast's prediction from one profile: calibrated terms, segments, limit plans.

The profile is a real one of a tiny GPT (one process); nothing here asserts a duration
measured on the clock, only how the prediction is built from it.
"""

from __future__ import annotations

import pytest

from trainwright.bench.forecast_model import (
    COPY_INFLATION_FLOOR,
    ForecastSpec,
    Profile,
    contention_configs,
    fit_inflation,
    plan_limit,
    predict,
    predicted_peaks,
)
from trainwright.bench.forecast_profile import _layers_and_batch
from trainwright.errors import ConfigError
from trainwright.plan.calibration import Calibration

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def profile():
    from trainwright.model.build import cross_entropy
    from trainwright.observe.tensor_profile import profile_tensors

    spec = ForecastSpec(n_blocks=2, d_model=32, n_heads=2, context=16, micro_batch_size=2)
    layers, x, y = _layers_and_batch(spec)
    rows = profile_tensors(layers, x, y, cross_entropy)
    # fixed times: the prediction's arithmetic, not this machine's speed, is under test
    for r in rows:
        r.forward_s, r.backward_s = 1e-3, 2e-3
    return spec, Profile(rows, [1e-4] * len(rows), 1e-4, 1e9, 1e10, 0.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_calibration_adds_overheads_and_shared_cores_but_no_bytes(profile, schedule):
    spec, prof = profile
    pp, m = (2 if schedule in ("interleaved-1f1b", "zb-v") else 4), 4  # 4 layers
    none = Calibration({}, 2)
    overhead = Calibration({}, 2, action_s=5e-4, segment_s=1e-4, send_s=1e-4, recv_s=2e-4)
    cores = Calibration({}, 2, slowdown={1: 1.0, 2: 1.5, 4: 3.0})
    base = predict(prof, spec, pp, m, schedule, "keep")
    assert predict(prof, spec, pp, m, schedule, "keep", none)["step_s"] == \
        pytest.approx(base["step_s"])
    over = predict(prof, spec, pp, m, schedule, "keep", overhead)
    # at least every F and B of one micro-batch's path pays its action overhead
    assert over["step_s"] >= base["step_s"] + 2 * m * 5e-4
    shared = predict(prof, spec, pp, m, schedule, "keep", cores)
    assert shared["slowdown"] > 1.0 and shared["step_s"] > base["step_s"]
    assert over["peak_bytes"] == shared["peak_bytes"] == base["peak_bytes"]


def test_limit_plans_follow_the_predicted_unconstrained_peak(profile):
    spec, prof = profile
    keep = predicted_peaks(prof, spec, 2, 8, "1f1b", "keep")["device"]
    loose, tight = (plan_limit(prof, spec, 2, 8, "1f1b", f) for f in (0.8, 0.3))
    assert loose["limits"] == [int(0.8 * p) for p in keep]
    assert len(loose["policies"]) == spec.n_layers
    kept = [sum(p == "keep" for p in x["policies"]) for x in (loose, tight)]
    assert kept[0] >= kept[1] and kept[0] < spec.n_layers
    for plan in (loose, tight):
        got = predicted_peaks(prof, spec, 2, 8, "1f1b", plan["policies"])["device"]
        for fits, peak, limit in zip(plan["fits"], got, plan["limits"], strict=True):
            assert not fits or peak <= limit  # what the planner says fits, the model agrees


def test_with_footprint_terms_peaks_and_limit_plans_come_from_the_footprint_model(profile):
    from dataclasses import replace

    from trainwright.pipeline.profile import profile_model

    spec, prof = profile
    layers, _, _, cfg = _layers_and_batch(spec, with_config=True)
    prof = replace(prof, table=profile_model(cfg, layers))
    keep = predicted_peaks(prof, spec, 2, 4, "1f1b", "keep")
    swap = predicted_peaks(prof, spec, 2, 4, "1f1b", "swap")
    assert keep["host"] == [0, 0] and all(h > 0 for h in swap["host"])  # host copies apart
    assert all(s < k for s, k in zip(swap["device"], keep["device"], strict=True))
    loose = plan_limit(prof, spec, 2, 4, "1f1b", 0.8)
    assert loose["requested_limits"] == [int(0.8 * p) for p in keep["device"]]
    got = predicted_peaks(prof, spec, 2, 4, "1f1b", loose["policies"])["device"]
    for fits, peak, limit in zip(loose["fits"], got, loose["limits"], strict=True):
        assert fits and peak < limit  # the plan a run's memory.limit makes, held to the walk
    # a limit no plan meets is raised to the smallest feasible (a run would refuse it)
    tiny = plan_limit(prof, spec, 2, 4, "1f1b", 0.01)
    assert all(u > r for u, r in zip(tiny["limits"], tiny["requested_limits"], strict=True))
    assert all(tiny["fits"])


def test_a_sweep_deeper_than_the_model_says_how_to_fix_it(profile):
    spec, prof = profile
    with pytest.raises(ValueError, match="raise n_blocks to at least 6"):
        predict(prof, spec, 4, 4, "zb-v", "keep")


def test_the_models_inflation_is_fitted_to_its_own_contention_run(profile):
    """The inflation at which the processor-sharing replay of the runs that keep every
    layer takes what they measured, then the copies' at which the run that swaps every
    layer does; predictions with them are the replay's. Without the transport measured
    there are none (1.0)."""
    spec, prof = profile
    cal = Calibration({}, 2, transport_s=3e-4)
    configs = [[4, 3, "1f1b", "keep"], [4, 3, "gpipe", "keep"], [4, 3, "1f1b", "swap"]]
    at = {x: [predict(prof, spec, *c, cal, *x)["step_s"] for c in configs]
          for x in ((1.0, 1.0), (1.4, 1.0), (1.4, 2.5))}
    assert at[1.4, 1.0][0] > at[1.0, 1.0][0] and at[1.4, 1.0][1] > at[1.0, 1.0][1]
    # the copies cost only where layers are swapped, and more with their inflation
    assert at[1.4, 2.5][:2] == at[1.4, 1.0][:2] and at[1.4, 2.5][2] > at[1.4, 1.0][2]
    fit = fit_inflation(prof, spec, cal, configs, at[1.4, 2.5])
    assert fit["inflation"] == pytest.approx(1.4, abs=1e-3)
    assert fit["copy_inflation"] == pytest.approx(2.5, abs=1e-3)
    one = fit_inflation(prof, spec, cal, configs[:1], at[1.4, 2.5][:1])
    assert one == {"inflation": pytest.approx(1.4, abs=1e-3), "copy_inflation": 1.0}
    assert fit_inflation(prof, spec, Calibration({}, 2), configs, at[1.4, 2.5]) == \
        {"inflation": 1.0, "copy_inflation": 1.0}
    # an all-swap run that took less than its copies alone would cost is noise: the copies
    # are fitted no cheaper than alone
    quick = predict(prof, spec, *configs[2], cal, 1.4, 0.6)["step_s"]
    assert quick < at[1.4, 1.0][2]
    floor = fit_inflation(prof, spec, cal, configs, [*at[1.4, 2.5][:2], quick])
    assert floor["copy_inflation"] == COPY_INFLATION_FLOOR == 1.0
    # where the all-swap run measured its copies, that ratio is the copies' term; the fit
    # to its step time is kept beside it
    measured = fit_inflation(prof, spec, cal, configs, at[1.4, 2.5], copies_measured=1.7)
    assert measured["copy_inflation"] == 1.7
    assert measured["copy_inflation_fitted"] == pytest.approx(2.5, abs=1e-3)
    assert measured["inflation"] == fit["inflation"]


def test_a_runs_copies_are_compared_with_the_profiles_round_by_round(profile):
    from dataclasses import replace

    from trainwright.bench.planner_forecast import copy_ratios

    _, prof = profile
    rounds = [{"swap_copy_cpu_s_per_byte": x} for x in (2e-10, 3e-10, 9e-10)]
    measured = replace(prof, copy_cpu_s_per_byte=1e-10)
    assert copy_ratios(measured, rounds) == pytest.approx([2.0, 3.0, 9.0])
    assert copy_ratios(prof, rounds) == []  # the profile did not measure its copies
    assert copy_ratios(measured, [{}, *rounds[:1]]) == pytest.approx([2.0])


def test_the_contention_runs_are_never_ones_the_sweep_judges():
    keys = [(2, 8, "1f1b", "keep"), (4, 4, "gpipe", "keep")]
    assert contention_configs(ForecastSpec(), keys) == [
        (2, 3, "1f1b", "keep"), (2, 3, "gpipe", "keep"), (2, 3, "1f1b", "swap"),
        (4, 3, "1f1b", "keep"), (4, 3, "gpipe", "keep"), (4, 3, "1f1b", "swap")]
    with pytest.raises(ConfigError, match="drop it from the sweep"):
        contention_configs(ForecastSpec(), [*keys, (4, 3, "gpipe", "keep")])
