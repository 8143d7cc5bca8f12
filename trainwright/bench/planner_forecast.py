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

Prediction: :func:`~trainwright.plan.simulate.simulate` over the schedule's action lists,
with stage costs from the profile (:func:`~trainwright.plan.planner.stage_costs`), and one
CPU rule the simulator does not know: ``p`` ranks on ``c`` cores cannot finish a step
faster than their summed compute over ``c`` (``max(simulated step, sum(busy) / c)``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trainwright.bench.paired import host_info, paired, round_order, seconds

__all__ = ["ForecastSpec", "Profile", "take_profile", "predict", "run_config", "run"]

DEFAULT_CONFIGS = [  # (pp, micro-batches, schedule, policy)
    (2, 4, "gpipe", "keep"), (2, 4, "1f1b", "recompute"), (2, 8, "gpipe", "swap"),
    (2, 8, "1f1b", "keep"), (4, 4, "gpipe", "recompute"), (4, 4, "1f1b", "swap"),
    (4, 8, "gpipe", "keep"), (4, 8, "1f1b", "recompute"),
]


@dataclass(kw_only=True)
class ForecastSpec:
    """The GPT every configuration trains (fixed micro-batch size) and the configurations."""

    n_blocks: int = 6
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    micro_batch_size: int = 4
    steps: int = 17
    warmup: int = 2
    repeats: int = 2
    profile_repeats: int = 5
    configs: list = field(default_factory=lambda: [list(c) for c in DEFAULT_CONFIGS])

    def parts(self, pp: int) -> list[int]:
        """Layers per stage, as even as possible (the first stages get the extra ones)."""
        n = self.n_blocks + 2
        return [n // pp + (s < n % pp) for s in range(pp)]

    def overrides(self, pp: int, mbs: int, schedule: str, policy: str) -> list[str]:
        """``--set`` values of one configuration."""
        return [f"model.n_blocks={self.n_blocks}", f"model.d_model={self.d_model}",
                f"model.n_heads={self.n_heads}", f"model.context={self.context}",
                'model.factory="trainwright.bench.live_meter:bench_gpt"',
                'data.factory="trainwright.bench.live_meter:bench_data"', "data.max_bytes=1000000",
                f"train.batch_size={mbs * self.micro_batch_size}",
                f"train.micro_batches={mbs}", f'train.schedule="{schedule}"',
                "train.optimizer=sgd", "train.lr=0.01", f"parallel.pp={pp}",
                f"parallel.partition={self.parts(pp)}", "parallel.threads_per_rank=1",
                f'memory.policies=["{policy}"]', "run.report=false", "run.progress=false",
                "run.checkpoint_every=0", "run.trace_steps=0", "run.profile_every=1000"]


@dataclass
class Profile:
    """Everything the prediction knows, measured once."""

    rows: list
    """:class:`~trainwright.observe.tensor_profile.LayerTensors` per layer (median times)."""
    opt_step_s: list[float]
    """SGD step per layer."""
    latency_s: float
    bandwidth_Bps: float
    host_bandwidth_Bps: float
    wall_s: float

    def summary(self) -> dict:
        """JSON view (per-layer times and bytes, links)."""
        return {"layers": [{"name": r.name, "forward_s": r.forward_s,
                            "backward_s": r.backward_s, "saved_bytes": r.saved_bytes,
                            "input_bytes": r.input_bytes, "output_bytes": r.output_bytes}
                           for r in self.rows],
                "opt_step_s": self.opt_step_s, "latency_s": self.latency_s,
                "bandwidth_Bps": self.bandwidth_Bps,
                "host_bandwidth_Bps": self.host_bandwidth_Bps, "wall_s": self.wall_s}


def _layers_and_batch(spec: ForecastSpec):
    from trainwright.config import load_config
    from trainwright.model.build import build_data, build_layers

    cfg = load_config(None, spec.overrides(2, 4, "1f1b", "keep"))
    os.environ.pop("TW_BENCH_METER", None)
    layers = build_layers(cfg)
    x, y = build_data(cfg).batch(0, spec.micro_batch_size)
    return layers, x, y


def _link_worker(rank: int, world: int, out_dir: str) -> None:
    from trainwright.dist.probe import measure_p2p

    small = measure_p2p(nbytes=64, repeats=20)
    big = measure_p2p(nbytes=4 * 2**20, repeats=5)
    if rank == 0:
        Path(out_dir, "links.json").write_text(json.dumps(
            {"small": small.bandwidth[0][1], "big": big.bandwidth[0][1]}))


def _measure_links() -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo ping-pong (message + 4-byte ack per round)."""
    from trainwright.dist.testing import run_workers

    with tempfile.TemporaryDirectory() as d:
        run_workers(_link_worker, 2, d, timeout_s=300)
        got = json.loads(Path(d, "links.json").read_text())
    latency = 64 / got["small"] / 2
    bandwidth = 1 / max(1 / got["big"] - 2 * latency / (4 * 2**20), 1e-12)
    return latency, bandwidth


def _host_bandwidth() -> float:
    src = torch.randn(2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(times)


def _opt_step_times(layers) -> list[float]:
    out = []
    for _, m in layers:
        params = list(m.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(params, lr=0.0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        out.append(statistics.median(times))
    return out


def take_profile(spec: ForecastSpec) -> Profile:
    """The one profile: single process, one thread, one micro-batch (see module docstring)."""
    from trainwright.model.build import cross_entropy
    from trainwright.observe.tensor_profile import profile_tensors

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers, x, y = _layers_and_batch(spec)
        runs = [profile_tensors(layers, x, y, cross_entropy) for _ in range(spec.profile_repeats)]
        rows = runs[-1]
        for i, r in enumerate(rows):
            r.forward_s = statistics.median(run[i].forward_s for run in runs)
            r.backward_s = statistics.median(run[i].backward_s for run in runs)
        opt = _opt_step_times(layers)
        host = _host_bandwidth()
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth = _measure_links()
    return Profile(rows, opt, latency, bandwidth, host, time.perf_counter() - t0)


def predict(profile: Profile, spec: ForecastSpec, pp: int, mbs: int, schedule: str,
            policy: str, cores: int | None = None) -> dict:
    """Predicted step time and per-stage peak of one configuration, from the profile only."""
    from trainwright.bench.planner_predict import _layer_policy_placement
    from trainwright.plan.planner import stage_costs
    from trainwright.plan.simulate import Links, simulate
    from trainwright.schedule.actions import build_schedule

    parts = spec.parts(pp)
    idx = [list(range(sum(parts[:s]), sum(parts[: s + 1]))) for s in range(pp)]
    placement = _layer_policy_placement(profile.rows, idx,
                                        {i: policy for i in range(len(profile.rows))})
    step_s = [sum(profile.opt_step_s[i] for i in layers) for layers in idx]
    costs = stage_costs(profile.rows, idx, placement, list(range(pp)), step_s, [0.0] * pp)
    bw = [[0.0 if i == j else profile.bandwidth_Bps for j in range(pp)] for i in range(pp)]
    links = Links(list(range(pp)), bw, host_bandwidth=profile.host_bandwidth_Bps,
                  latency_s=profile.latency_s)
    sim = simulate(build_schedule(schedule, pp, mbs), costs, links)
    cores = cores or os.cpu_count() or 1
    work_bound = sum(sim.busy_s) / cores
    return {"step_s": max(sim.step_s, work_bound), "schedule_bound_s": sim.step_s,
            "work_bound_s": work_bound, "peak_bytes": list(sim.own_peak_bytes)}


def run_config(spec: ForecastSpec, config: list, work: Path, tag: str) -> dict:
    """Train one configuration with ``python -m trainwright run``; what its run measured.

    Returns the median telemetry step time after warm-up, the store's per-stage peak, and
    the live-storage meter's per-stage peak (metered during the warm-up steps only).
    """
    pp, mbs, schedule, policy = config
    name = f"{tag}-pp{pp}-m{mbs}-{schedule}-{policy}"
    meter_dir = work / f"{name}-meter"
    meter_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TW_BENCH_METER_DIR": str(meter_dir),
           "TW_BENCH_METER_STEPS": str(spec.warmup)}
    sets = [*spec.overrides(pp, mbs, schedule, policy), f"train.steps={spec.steps}",
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
    return {"step_s": statistics.median(r["step_time_s"] for r in steps[spec.warmup:]),
            "store_peak_bytes": [max(r["stages"][s]["activation_peak_bytes"] for r in steps)
                                 for s in range(pp)],
            "metered_peak_bytes": [
                json.loads((meter_dir / f"rank{s}.json").read_text())["peak_bytes"]
                for s in range(pp)]}


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas else 0.0


def run(spec: ForecastSpec, progress=None) -> dict:
    """Profile once, predict every configuration, run each, compare; the JSON's fields."""
    say = progress or (lambda _: None)
    say("profile (one process, one micro-batch)")
    profile = take_profile(spec)
    keys = [tuple(c) for c in spec.configs]
    preds = {k: predict(profile, spec, *k) for k in keys}
    runs: dict = {k: [] for k in keys}
    with tempfile.TemporaryDirectory(prefix="tw-forecast-") as d:
        for r in range(spec.repeats):
            for k in round_order(keys, r):
                say(f"round {r + 1}/{spec.repeats}: pp {k[0]}, {k[1]} micro-batches, {k[2]}, "
                    f"{k[3]}")
                runs[k].append(run_config(spec, list(k), Path(d), f"r{r}"))
    return _result(spec, profile, keys, preds, runs)


def _config_row(k, pred, runs) -> dict:
    times = [r["step_s"] for r in runs]
    step = statistics.median(times)
    met = {key: [max(v) for v in zip(*(r[key] for r in runs), strict=True)]
           for key in ("metered_peak_bytes", "store_peak_bytes")}
    peak_err = [_err(p, m) for p, m in zip(pred["peak_bytes"], met["metered_peak_bytes"],
                                           strict=True)]
    return {"pp": k[0], "micro_batches": k[1], "schedule": k[2], "policy": k[3],
            "predicted_step_s": round(pred["step_s"], 5),
            "schedule_bound_s": round(pred["schedule_bound_s"], 5),
            "work_bound_s": round(pred["work_bound_s"], 5),
            "measured_step_s": round(step, 5),
            "measured_step_s_per_round": [seconds(t) for t in times],
            "step_error": round(_err(pred["step_s"], step), 4),
            "predicted_peak_bytes": pred["peak_bytes"],
            "metered_peak_bytes": met["metered_peak_bytes"],
            "store_peak_bytes": met["store_peak_bytes"],
            "peak_error_max": round(max(peak_err), 4),
            "peak_error_vs_store_max": round(max(
                _err(p, m) for p, m in zip(pred["peak_bytes"], met["store_peak_bytes"],
                                           strict=True)), 4)}


def _result(spec, profile, keys, preds, runs) -> dict:
    rows = [_config_row(k, preds[k], runs[k]) for k in keys]
    meas = {k: [r["step_s"] for r in runs[k]] for k in keys}
    errs = [r["step_error"] for r in rows]
    best_pred = min(rows, key=lambda r: r["predicted_step_s"])
    best_meas = min(r["measured_step_s"] for r in rows)
    # per round: the median over configurations of measured / predicted (drift shows here)
    rounds = list(zip(*(meas[k] for k in keys), strict=True))
    pred_list = [preds[k]["step_s"] for k in keys]
    per_round = [statistics.median(m / p for m, p in zip(rnd, pred_list, strict=True))
                 for rnd in rounds]
    pr = paired(per_round, [1.0] * len(per_round))
    return {
        "question": "from one single-process profile, does the simulator predict the step "
                    "time and per-stage peak of trainwright runs it never saw?",
        "spec": asdict(spec), "profile": profile.summary(), "configs": rows,
        "peak_meter": "LiveStorageMeter (trainwright/bench/live_meter.py) inside each "
                      "trainwright run, during its warm-up steps (max over rounds)",
        "predict_step_error_median": round(statistics.median(errs), 4),
        "predict_step_error_max": round(max(errs), 4),
        "predict_peak_error_max": round(max(r["peak_error_max"] for r in rows), 4),
        "predict_peak_error_vs_store_max": round(max(r["peak_error_vs_store_max"]
                                                     for r in rows), 4),
        "best_predicted": {k: best_pred[k] for k in ("pp", "micro_batches", "schedule",
                                                     "policy")},
        "best_predicted_vs_best_measured": round(best_pred["measured_step_s"] / best_meas, 4),
        "paired_ratios": pr["paired_ratios"], "ratio": pr["ratio"],
        "ratio_spread": pr["ratio_spread"],
        "ratio_note": "per round, the median over configurations of measured / predicted "
                      "step time (all configurations run in that round, ABBA order)",
        "host": host_info(),
    }
