"""Paired rounds on a drifting machine: the one way every benchmark compares systems.

These machines change speed by 15-30 % over minutes, so a system's median taken over
rounds can come from a different round than its peer's. Every benchmark therefore:

* runs its systems in rounds, in alternating (ABBA) order: ``round_order``;
* takes, per round, the ratio of the two systems measured in that round: ``paired``;
* reports the median of those paired ratios as the headline, with their spread and a
  90 % interval: ``interval`` (a bootstrap of the median; the worst and best round where
  rounds are too few for a bootstrap);
* judges each target on the interval's far end, never the median: ``verdict``;
* names the machine it ran on: ``host_info``.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence


def round_order(systems: Sequence[str], round_index: int) -> list[str]:
    """Systems in the order to run them in round ``round_index``: forward, then reversed.

    Alternating the order (ABBA) cancels a drift that is linear within a round.
    """
    names = list(systems)
    return names if round_index % 2 == 0 else names[::-1]


def balanced_rounds(rounds: int) -> int:
    """The least even number of rounds >= ``rounds``: under :func:`round_order` every system
    then runs first in as many rounds as it runs last."""
    return rounds + rounds % 2


def spread(values: Sequence[float]) -> dict:
    """Min, max and the half-range relative to the median of ``values``."""
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"min": round(lo, 4), "max": round(hi, 4),
            "relative_half_range": round((hi - lo) / (2 * med), 4) if med else None}


def seconds(value: float) -> float:
    """A time in seconds kept to 6 significant digits for a bench JSON: fixed decimals
    would lose the precision of millisecond steps that ratios are computed from."""
    return float(f"{value:.6g}")


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    """Per-round ratios ``numerator[i] / denominator[i]`` and their median and spread.

    Both sequences hold one figure per round, measured in the same round. The result
    has ``paired_ratios`` (one per round), ``ratio`` (their median: the headline) and
    ``ratio_spread`` and ``interval`` (90 %, see :func:`interval`).
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"paired ratios need one figure per round from each system, got "
                         f"{len(numerator)} and {len(denominator)}")
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"paired_ratios": [round(r, 4) for r in ratios],
            "ratio": round(statistics.median(ratios), 4),
            "ratio_spread": spread(ratios),
            "interval": list(interval(ratios))}


#: Fewer paired rounds than this and the interval is the range of the rounds (min, max):
#: a bootstrap of the median over 2-4 values only resamples those values anyway.
MIN_BOOTSTRAP_ROUNDS = 5


def interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float]:
    """The ``confidence`` interval (low, high) of the median of per-round ``values``.

    A percentile bootstrap (``scipy.stats.bootstrap``, seeded so a JSON is reproducible)
    from :data:`MIN_BOOTSTRAP_ROUNDS` rounds up; below that, the worst and best round.
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("an interval needs at least one paired round")
    if len(vals) < MIN_BOOTSTRAP_ROUNDS or min(vals) == max(vals):
        return round(min(vals), 4), round(max(vals), 4)
    import numpy as np
    from scipy.stats import bootstrap
    res = bootstrap((np.asarray(vals),), np.median, confidence_level=confidence,
                    method="percentile", n_resamples=2000, rng=np.random.default_rng(0))
    lo, hi = res.confidence_interval
    return round(float(lo), 4), round(float(hi), 4)


def verdict(bounds: Sequence[float], target: float, *, at_most: bool = True) -> str:
    """``"met"`` when the whole interval ``bounds`` clears ``target``, else ``"missed"``.

    ``at_most`` targets (a ratio that must stay at or under ``target``) are judged on the
    interval's high end; the others (at least ``target``) on its low end.
    """
    lo, hi = bounds
    far = hi if at_most else lo
    return "met" if (far <= target if at_most else far >= target) else "missed"


def judged(values: Sequence[float], target: float, *, at_most: bool = True) -> dict:
    """Median, 90 % interval and verdict of per-round ``values`` against ``target``: the
    block every bench JSON carries beside a headline."""
    bounds = interval(values)
    return {"median": round(statistics.median(values), 4), "interval": list(bounds),
            "target": target, "target_is": "at_most" if at_most else "at_least",
            "verdict": verdict(bounds, target, at_most=at_most)}


def slowest_rank_step_s(per_rank: list[dict], warmup: int) -> float:
    """Median over the timed steps (after ``warmup``) of the slowest rank's step time;
    ``per_rank``: one record per rank with its ``step_times_s``."""
    per = [r["step_times_s"][warmup:] for r in per_rank]
    return statistics.median(max(ts) for ts in zip(*per, strict=True))


def _first_cpu() -> dict[str, str]:
    """``/proc/cpuinfo``'s fields for the first processor (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def host_info() -> dict:
    """The machine a benchmark ran on: CPU model, cores and library versions.

    ``cpu_id`` (family, model and stepping, where ``/proc/cpuinfo`` has them) tells apart
    CPUs that a virtual machine names alike (every generation here reads "AMD EPYC")."""
    import numpy
    import torch
    cpu = _first_cpu()
    info = {"cpu_model": cpu.get("model name") or platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "platform": platform.platform()}
    if "cpu family" in cpu:
        info["cpu_id"] = (f"family {cpu['cpu family']} model {cpu.get('model')} "
                          f"stepping {cpu.get('stepping')}")
    try:
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        info["deepspeed"] = None
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info
