"""Predict ``trainwright run`` from one profile, then run it: the planner's forecast test.

Question: from **one profile** of the model (per-layer forward/backward times and saved
tensor sizes, measured once in a single process on one micro-batch; the optimizer step per
layer; a gloo ping-pong between two processes; a host copy), does the simulator predict
the step time and every stage's activation peak of configurations it never saw, differing
in pipeline depth, micro-batches, schedule and memory policy?

Each configuration then trains for real with ``trainwright run`` (the CLI, its launcher and
Trainer): step time from the run's own telemetry (``metrics.jsonl``, median after
warm-up), per-stage peak from an independent instrument, the live-storage meter
(:mod:`~trainwright.bench.live_meter`) during the run's warm-up steps (the store's own
accounting is reported beside it). Configurations run in rounds, in alternating order.

Configurations: pp 2 and 4; 2, 4 and 8 micro-batches; GPipe, 1F1B, ZB-H1, ZB-H2,
interleaved 1F1B and ZB-V (two chunks per rank); every layer kept, recomputed or swapped,
and plans made under a limit of 30 %, 50 % and 80 % of each stage's predicted
unconstrained peak (``limitNN``: the planner, :func:`~trainwright.plan.planner.make_plan`
with host swap and recompute, plans from the profile; the run executes the plan's
per-layer policies).

Prediction (:mod:`~trainwright.bench.forecast_model`):
:func:`~trainwright.plan.simulate.simulate` over the schedule's action lists,
with stage costs from the profile (:func:`~trainwright.plan.stage_inputs.stage_costs`) and the
machine's calibration (:mod:`~trainwright.plan.calibration`, measured by
:mod:`~trainwright.bench.calibrate` three times between the profile's takes, the median of
each term, and cached): per-action, per-segment, send and receive
overhead, the delivery of messages among ranks sharing the host, and ranks sharing the
host's cores (the processor-sharing replay, :mod:`~trainwright.plan.sharing`, with the
transport threads' CPU per message). One term is the model's, not the machine's: its
compute under shared cores runs ``inflation`` times its profile (caches evicted by the
other ranks), fitted per rank count to runs of the model the sweep does not judge
(:data:`~trainwright.bench.forecast_model.CONTENTION_RUNS`: 1F1B and GPipe with 3
micro-batches and every layer kept), timed in every round with the others
(:func:`~trainwright.bench.forecast_model.fit_inflation`); and its host-swap copies
``copy_inflation`` times their single-process time (the memory shared with the other
ranks' work), measured in the third such run, 1F1B swapping every layer: the copies' thread
CPU per byte there over the profile's (:func:`copy_ratios`). Per-stage peaks come from one
call, :func:`~trainwright.bench.forecast_model.predicted_peaks`: the footprint model
(:mod:`~trainwright.plan.footprint`), device and host apart, from the same profile's
working-set terms; limits are planned as a run's ``memory.limit`` plans them
(:func:`~trainwright.plan.fit.fit_plan`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from trainwright.bench.forecast_model import (
    ForecastSpec,
    Profile,
    contention_configs,
    fit_inflation,
    inflations_of,
    merged,
    plan_limit,
    predict,
    predicted_peaks,
)
from trainwright.bench.forecast_profile import take_profile
from trainwright.bench.noise_floor import noise_floor
from trainwright.bench.paired import host_info, paired, round_order, seconds, verdict

__all__ = ["run_config", "run", "copy_ratios"]

TARGETS = {"predict_step_error_median": 0.08, "predict_step_error_max": 0.15,
           "predict_peak_error_median": 0.03, "predict_peak_error_max": 0.08,
           "plans_over_limit": 0, "best_predicted_vs_best_measured": 1.05}
"""Issue 32's targets (all at most)."""

MIN_PLANNED_STAGES = 40


def run_config(spec: ForecastSpec, config: list, work: Path, tag: str,
               policies: list[str] | None = None) -> dict:
    """Train one configuration with ``python -m trainwright run``; what its run measured.

    ``policies``: per-layer policies (a limit's plan) in place of the configuration's.
    Returns the median telemetry step time after warm-up, the store's per-stage peak, and
    the live-storage meter's per-stage peak (metered during the warm-up steps only;
    ``metered_host_peak_bytes`` too when the meter reports host copies apart); where layers
    were swapped to the host, ``swap_copy_cpu_s_per_byte``: the copies' thread CPU seconds
    over their bytes after warm-up, every stage's together.
    """
    pp, mbs, schedule, policy = config
    name = f"{tag}-pp{pp}-m{mbs}-{schedule}-{policy}"
    meter_dir = work / f"{name}-meter"
    meter_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TW_BENCH_METER_DIR": str(meter_dir),
           "TW_BENCH_METER_STEPS": str(spec.warmup)}
    sets = [*spec.overrides(pp, mbs, schedule, policies or policy), f"train.steps={spec.steps}",
            f'run.dir="{work}"', f'run.name="{name}"']
    cmd = [sys.executable, "-m", "trainwright", "run"]
    for s in sets:
        cmd += ["--set", s]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if got.returncode != 0:
        raise RuntimeError(f"trainwright run {name} failed ({got.returncode}): "
                           f"{got.stderr.strip()[-2000:]}")
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    meter = [json.loads((meter_dir / f"rank{s}.json").read_text()) for s in range(pp)]
    out = {"step_s": statistics.median(r["step_time_s"] for r in steps[spec.warmup:]),
           "store_peak_bytes": [max(r["stages"][s]["activation_peak_bytes"] for r in steps)
                                for s in range(pp)],
           "metered_peak_bytes": [m["peak_bytes"] for m in meter]}
    if all("host_peak_bytes" in m for m in meter):
        out["metered_host_peak_bytes"] = [m["host_peak_bytes"] for m in meter]
    copied = [st for r in steps[spec.warmup:] for st in r["stages"] if "swap_copied_bytes" in st]
    if copied:
        out["swap_copy_cpu_s_per_byte"] = (sum(st["swap_copy_cpu_s"] for st in copied)
                                           / sum(st["swap_copied_bytes"] for st in copied))
    return out


def copy_ratios(profile: Profile, runs: list[dict]) -> list[float]:
    """A contention run's host-swap copies over the same copies in one process, per round:
    their thread CPU per byte over the profile's (none where either did not measure it).
    Thread CPU time leaves out the moments other ranks held the cores (the replay's
    processor sharing adds those), and keeps what sharing the memory costs the copies
    themselves; the median over the rounds is the copies' inflation."""
    if not profile.copy_cpu_s_per_byte:
        return []
    return [r["swap_copy_cpu_s_per_byte"] / profile.copy_cpu_s_per_byte for r in runs
            if "swap_copy_cpu_s_per_byte" in r]


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas else 0.0


PROFILE_TAKES = 3
"""Takes of the profile the forecast's one profile is the median of (:func:`merged`), and
of the calibration likewise (:meth:`~trainwright.plan.calibration.Calibration.median_of`):
profile, calibration, profile, calibration, ..."""


def _calibration(spec: ForecastSpec, takes: list):
    """The median of ``takes``, measured afresh in this run (the machine's state now is
    the one the runs see; a cache from a loaded hour would skew the sweep), and cached for
    ``trainwright plan``."""
    from trainwright.plan.calibration import Calibration, default_path, save

    cal = Calibration.median_of(takes)
    save(Path(spec.calibration) if spec.calibration else default_path(), cal)
    return cal


def run(spec: ForecastSpec, progress=None) -> dict:
    """Profile and calibrate (three takes of each, alternating, each merged into one by
    the median of its terms: :func:`merged`), plan the limits, predict every
    configuration, run each in rounds (alternating order), compare; the JSON's fields
    (``calibration_takes``: each take's receive, send and transport terms).

    ``progress(description, done, total)`` is told each run as it starts."""
    from trainwright.bench.calibrate import measure

    say = progress or (lambda *_: None)
    keys = [tuple(c) for c in spec.configs]
    total = spec.repeats * len(keys)
    takes, cals = [], []
    for i in range(PROFILE_TAKES):
        say(f"profile (one process, one micro-batch), take {i + 1}/{PROFILE_TAKES}", 0, total)
        takes.append(take_profile(spec))
        say(f"calibrate the machine, take {i + 1}/{PROFILE_TAKES}", 0, total)
        cals.append(measure(max_ranks=max(k[0] for k in keys)))
    profile, cal = merged(takes), _calibration(spec, cals)
    plans = {k: plan_limit(profile, spec, k[0], k[1], k[2], int(k[3][5:]) / 100)
             for k in keys if k[3].startswith("limit")}
    pols = {k: plans[k]["policies"] if k in plans else k[3] for k in keys}
    probes = contention_configs(spec, keys)
    runs: dict = {k: [] for k in [*keys, *probes]}
    done, total = 0, total + spec.repeats * len(probes)
    with tempfile.TemporaryDirectory(prefix="tw-forecast-") as d:
        for r in range(spec.repeats):
            for k in round_order([*keys, *probes], r):
                say(f"round {r + 1}/{spec.repeats}: pp {k[0]}, {k[1]} micro-batches, {k[2]}, "
                    f"{k[3]}", done, total)
                runs[k].append(run_config(spec, list(k), Path(d), f"r{r}",
                                          plans[k]["policies"] if k in plans else None))
                done += 1
    say("done", done, total)
    # the model's compute under shared cores fitted to its contention runs alone, and its
    # copies measured in the one that swaps every layer
    contention: dict[int, dict] = {}
    copies: dict[int, float | None] = {}
    for k in probes:
        c = contention.setdefault(k[0], {"configs": [], "measured_step_s": [],
                                         "measured_step_s_per_round": []})
        c["configs"].append(list(k))
        probe = runs.pop(k)
        times = [x["step_s"] for x in probe]
        c["measured_step_s"].append(statistics.median(times))
        c["measured_step_s_per_round"].append([round(t, 5) for t in times])
        ratios = copy_ratios(profile, probe) if k[3] == "swap" else []
        if ratios:
            copies[k[0]] = statistics.median(ratios)
            c["copy_ratio_per_round"] = [round(x, 4) for x in ratios]
    for pp, c in contention.items():
        c.update(fit_inflation(profile, spec, cal, c["configs"], c["measured_step_s"],
                               copies.get(pp)))
    preds = {k: {**predict(profile, spec, k[0], k[1], k[2], pols[k], cal,
                           *inflations_of(contention.get(k[0]))),
                 "uncalibrated_step_s": predict(profile, spec, *k[:3], pols[k])["step_s"],
                 "peaks": predicted_peaks(profile, spec, *k[:3], pols[k])} for k in keys}
    out = _result(spec, profile, cal, keys, preds, plans, runs)
    out["contention"] = {str(pp): c for pp, c in sorted(contention.items())}
    out["calibration_takes"] = [{"recv_s": c.recv_s, "send_s": c.send_s,
                                 "transport_s": c.transport_s} for c in cals]
    return out


def _config_row(spec, k, pred, plan, runs) -> dict:
    times = [r["step_s"] for r in runs]
    step = statistics.median(times)
    met = {key: [max(v) for v in zip(*(r[key] for r in runs), strict=True)]
           for key in ("metered_peak_bytes", "store_peak_bytes", "metered_host_peak_bytes")
           if all(key in r for r in runs)}
    peak_err = [_err(p, m) for p, m in zip(pred["peaks"]["device"], met["metered_peak_bytes"],
                                           strict=True)]
    samples = k[1] * spec.micro_batch_size
    row = {"pp": k[0], "micro_batches": k[1], "schedule": k[2], "policy": k[3],
           "samples_per_step": samples,
           "predicted_step_s": round(pred["step_s"], 5),
           "predicted_step_s_uncalibrated": round(pred["uncalibrated_step_s"], 5),
           "predicted_slowdown": round(pred["slowdown"], 4),
           "measured_step_s": round(step, 5),
           "measured_step_s_per_round": [seconds(t) for t in times],
           "step_error": round(_err(pred["step_s"], step), 4),
           "step_error_uncalibrated": round(_err(pred["uncalibrated_step_s"], step), 4),
           "predicted_samples_per_s": round(samples / pred["step_s"], 3),
           "measured_samples_per_s": round(samples / step, 3),
           "predicted_peak_bytes": pred["peaks"]["device"],
           "metered_peak_bytes": met["metered_peak_bytes"],
           "store_peak_bytes": met["store_peak_bytes"],
           "peak_errors": [round(e, 4) for e in peak_err],
           "peak_error_max": round(max(peak_err), 4),
           "peak_error_vs_store_max": round(max(
               _err(p, m) for p, m in zip(pred["peak_bytes"], met["store_peak_bytes"],
                                          strict=True)), 4)}
    host_pred = pred["peaks"]["host"]
    if host_pred is not None and "metered_host_peak_bytes" in met:
        row["predicted_host_peak_bytes"] = host_pred
        row["metered_host_peak_bytes"] = met["metered_host_peak_bytes"]
        row["host_peak_errors"] = [round(_err(p, m), 4) for p, m in
                                   zip(host_pred, met["metered_host_peak_bytes"], strict=True)]
    if plan is not None:
        row.update({"limit_bytes": plan["limits"], "planned_fits": plan["fits"],
                    "planned_policies": plan["policies"],
                    "over_limit": [bool(f and m > lim) for f, m, lim in zip(
                        plan["fits"], met["metered_peak_bytes"], plan["limits"], strict=True)]})
    return row


def _target(value: float, target: float, at_most: bool = True) -> dict:
    """A target judged on the value itself: these are per-configuration errors (their
    median or max over the sweep), or counts, not paired per-round ratios."""
    return {"value": value, "target": target, "target_is": "at_most" if at_most else "at_least",
            "verdict": verdict((value, value), target, at_most=at_most),
            "judged_on": "the value itself (a median / max / count over the sweep's "
                         "configurations, not a paired ratio)"}


def _result(spec, profile, cal, keys, preds, plans, runs) -> dict:
    rows = [_config_row(spec, k, preds[k], plans.get(k), runs[k]) for k in keys]
    meas = {k: [r["step_s"] for r in runs[k]] for k in keys}
    errs = [r["step_error"] for r in rows]
    raw = [r["step_error_uncalibrated"] for r in rows]
    peak_errs = [e for r in rows for e in r["peak_errors"]]
    host_errs = [e for r in rows for e in r.get("host_peak_errors", [])]
    # ranked by samples/s: the configurations train different batch sizes
    best_pred = max(rows, key=lambda r: r["predicted_samples_per_s"])
    best_meas = max(r["measured_samples_per_s"] for r in rows)
    planned = [r for r in rows if "over_limit" in r]
    planned_stages = sum(sum(r["planned_fits"]) for r in planned)
    over = sum(sum(r["over_limit"]) for r in planned)
    # per round: the median over configurations of measured / predicted (drift shows here)
    rounds = list(zip(*(meas[k] for k in keys), strict=True))
    pred_list = [preds[k]["step_s"] for k in keys]
    per_round = [statistics.median(m / p for m, p in zip(rnd, pred_list, strict=True))
                 for rnd in rounds]
    pr = paired(per_round, [1.0] * len(per_round))
    out = {
        "question": "from one single-process profile and the machine's calibration, does the "
                    "simulator predict the step time and per-stage peak of trainwright runs "
                    "it never saw, and do plans made under a limit fit by the meter?",
        "spec": asdict(spec), "profile": profile.summary(), "calibration": cal.to_dict(),
        "configs": rows,
        "peak_meter": "LiveStorageMeter (trainwright/bench/live_meter.py) inside each "
                      "trainwright run, during its warm-up steps (max over rounds)",
        "predict_step_error_median": round(statistics.median(errs), 4),
        "predict_step_error_max": round(max(errs), 4),
        "predict_step_error_uncalibrated_median": round(statistics.median(raw), 4),
        "predict_step_error_uncalibrated_max": round(max(raw), 4),
        "predict_peak_error_median": round(statistics.median(peak_errs), 4),
        "predict_peak_error_max": round(max(peak_errs), 4),
        "predict_peak_error_vs_store_max": round(max(r["peak_error_vs_store_max"]
                                                     for r in rows), 4),
        "plans_over_limit": over, "planned_stages": planned_stages,
        "best_predicted": {k: best_pred[k] for k in ("pp", "micro_batches", "schedule",
                                                     "policy")},
        "best_predicted_vs_best_measured": round(best_meas / best_pred["measured_samples_per_s"],
                                                 4),
        "best_ranked_by": "samples/s (configurations train different batch sizes)",
        "paired_ratios": pr["paired_ratios"], "ratio": pr["ratio"],
        "ratio_spread": pr["ratio_spread"],
        "ratio_note": "per round, the median over configurations of measured / predicted "
                      "step time (all configurations run in that round, ABBA order)",
        "step_error_noise_floor": noise_floor([meas[k] for k in keys]),
        "host": host_info(),
    }
    if host_errs:
        out["predict_host_peak_error_median"] = round(statistics.median(host_errs), 4)
        out["predict_host_peak_error_max"] = round(max(host_errs), 4)
    verdicts = {key: _target(out[key], t) for key, t in TARGETS.items()}
    for key in ("predict_host_peak_error_median", "predict_host_peak_error_max"):
        if key in out:
            verdicts[key] = _target(out[key], TARGETS[key.replace("host_", "")])
    verdicts["planned_stages"] = _target(planned_stages, MIN_PLANNED_STAGES, at_most=False)
    out["verdicts"] = verdicts
    return out
