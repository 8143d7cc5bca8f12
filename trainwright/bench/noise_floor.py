"""The step-error targets' noise floor: what a predictor that knew every configuration's
typical step time exactly would score against runs as noisy as the sweep's own.

Each configuration's measured step is the median of its rounds, and on a shared machine
those rounds differ: the same ``trainwright run`` measured 136, 156, 160 and 152 ms back to
back (2026-12-08), and the planner sweep's rounds of one configuration have a log standard
deviation of 0.10-0.18. A median or max of per-configuration errors cannot be judged
without knowing how much of it that noise alone makes.

:func:`noise_floor` resamples the sweep's own per-round deviations: every round's log step
time less its configuration's mean log, pooled over configurations and widened by
``sqrt(n / (n - 1))`` (they were taken from a mean of ``n``); it draws ``n`` of them per
configuration, takes their median as the sweep does, and scores it against the pool's
median (the typical round, which a perfect prediction would name): error
``exp(median of the draws - median of the pool) - 1``. Over many such sweeps: percentiles
of the median and of the max absolute error. Pure: no torch.
"""

from __future__ import annotations

import math
import random
import statistics

__all__ = ["noise_floor"]


def noise_floor(rounds: list[list[float]], draws: int = 2000, seed: int = 0) -> dict:
    """The noise floor of the step errors of a sweep whose configurations took ``rounds``
    (seconds per round, as many rounds for each); ``{}`` with fewer than two rounds.

    Returns:
        ``rounds``; ``per_round_log_sd`` (the pooled, widened deviations' standard
        deviation); ``step_error_median`` and ``step_error_max``, each ``{"p10", "p50",
        "p90"}`` over ``draws`` resampled sweeps (seeded: the same rounds give the same
        floor); ``method``.
    """
    n = len(rounds[0]) if rounds else 0
    if n < 2 or any(len(r) != n for r in rounds):
        return {}
    widen = math.sqrt(n / (n - 1))
    pool = []
    for r in rounds:
        logs = [math.log(t) for t in r]
        mean = statistics.fmean(logs)
        pool += [widen * (x - mean) for x in logs]
    typical = statistics.median(pool)
    rng = random.Random(seed)
    medians, maxes = [], []
    for _ in range(draws):
        errs = [abs(math.expm1(statistics.median(rng.choices(pool, k=n)) - typical))
                for _ in rounds]
        medians.append(statistics.median(errs))
        maxes.append(max(errs))
    return {"rounds": n, "per_round_log_sd": round(statistics.pstdev(pool), 4),
            "step_error_median": _percentiles(medians),
            "step_error_max": _percentiles(maxes),
            "method": "the sweep's own per-round deviations (log step time less its "
                      "configuration's mean, pooled, widened by sqrt(n/(n-1))) resampled "
                      f"{draws} times: n per configuration, their median against the pool's "
                      "median, as a predictor exact on every configuration's typical round "
                      "would score"}


def _percentiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return {"p10": round(q[0], 4), "p50": round(statistics.median(xs), 4),
            "p90": round(q[-1], 4)}
