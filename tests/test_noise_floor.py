"""The step-error targets' noise floor: a perfect predictor scored against noisy rounds."""

import math

from trainwright.bench.noise_floor import noise_floor


def test_rounds_that_agree_leave_no_floor():
    got = noise_floor([[0.2, 0.2, 0.2], [0.1, 0.1, 0.1]], draws=50)
    assert got["per_round_log_sd"] == 0
    assert got["step_error_max"] == {"p10": 0, "p50": 0, "p90": 0}


def test_the_floor_grows_with_the_rounds_spread_and_stays_within_it():
    def sweep(d):
        return [[t, t * math.exp(d), t * math.exp(-d)] for t in (0.1 + i / 100 for i in range(28))]

    narrow, wide = noise_floor(sweep(0.05), draws=300), noise_floor(sweep(0.15), draws=300)
    # deviations 0 and +-d, widened by sqrt(3/2): no median of three lies beyond them
    bound = math.expm1(math.sqrt(1.5) * 0.05) + 1e-4  # figures are rounded to 4 places
    assert 0 < narrow["step_error_median"]["p50"] < narrow["step_error_max"]["p50"] <= bound
    assert wide["step_error_max"]["p50"] > 2 * narrow["step_error_max"]["p50"]
    assert noise_floor(sweep(0.05), draws=300) == narrow  # seeded


def test_one_round_has_no_floor():
    assert noise_floor([[0.1], [0.2]]) == {}
