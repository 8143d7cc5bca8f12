"""``trainwright bench planner``: is the simulator right, and does peer swap pay?

Questions:

1. **Forecast** (:mod:`~trainwright.bench.planner_forecast`): from one single-process
   profile and the machine's calibration (:mod:`~trainwright.bench.calibrate`), predict
   the step time and per-stage peak of 28 configurations (pp 2 and 4; 2, 4, 8
   micro-batches; GPipe, 1F1B, ZB-H1, ZB-H2, interleaved 1F1B, ZB-V; keep, recompute,
   swap, and plans under limits of 30 / 50 / 80 % of the unconstrained peak), then train
   each with ``trainwright run`` and compare: step error median and max, peak error
   median and max against the live-storage meter, plans over their limit, and the best
   predicted configuration against the best measured, by samples/s. Each target has a
   verdict (on the value itself: per-configuration errors, not paired ratios).
2. **Policy families alone** (4 stages, 1F1B, same model, same stage-0 limit): peer swap
   only, host swap only, recompute only; ``repeats`` rounds interleaved in one process
   group; median over rounds of the mean step time.
3. **Planning far past this machine:** a 175B GPT (96 blocks, d_model 12288, context 2048,
   bf16) on 1,024 GPUs (128 nodes of 8, NVSwitch), pp 64 x dp 16, profiled on the meta
   device: wall time of profile + plan, with torch's meta machinery already imported
   (``plan_175b_1024_s``) and from cold (``plan_175b_1024_cold_s``); CPU seconds too.
4. **One DGX-1 box** (8 V100 32 GB, NVLink hybrid cube-mesh): predicted step time and
   per-GPU peak of a GPT with and without peer swap.

All runs here use one thread per rank; the machine is shared, so every figure carries
other agents' CPU load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trainwright.bench.forecast_model import ForecastSpec
from trainwright.bench.paired import paired, round_order
from trainwright.bench.planner_forecast import run as run_forecast
from trainwright.bench.planner_predict import measured

__all__ = ["PlannerBenchSpec", "run", "main"]


@dataclass(kw_only=True)
class PlannerBenchSpec:
    """GPT (embed, blocks, head) trained by the pipeline harness."""

    n_blocks: int = 6
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    vocab: int = 256
    micro_batches: int = 8
    micro_batch_size: int = 4
    steps: int = 8
    warmup: int = 2
    limit_fraction: float = 0.6
    stage_counts: list = field(default_factory=lambda: [2, 4])
    schedules: list = field(default_factory=lambda: ["gpipe", "1f1b"])

    def parts(self, stages: int) -> list[int]:
        """Layers per stage: the first stage gets the extra layers (it is the heavy one)."""
        n = self.n_blocks + 2
        return [n // stages + (s < n % stages) for s in range(stages)]

    def job(self, stages: int, schedule: str, steps: int | None = None):
        """The harness job."""
        from trainwright.run.harness import GPTJob

        return GPTJob(n_blocks=self.n_blocks, d_model=self.d_model, n_heads=self.n_heads,
                      context=self.context, vocab=self.vocab, parts=self.parts(stages),
                      schedule=schedule, micro_batches=self.micro_batches,
                      micro_batch_size=self.micro_batch_size, steps=steps or self.steps,
                      lr=0.01, timeout_s=120.0)


# ---- spawned workers ------------------------------------------------------------------

def _warm_up(spec: PlannerBenchSpec, stages: int) -> None:
    from trainwright.run.harness import run_gpt_pipeline

    run_gpt_pipeline(spec.job(stages, "1f1b", steps=2))  # allocator, kernels, gloo pairs


def _slim(res: dict) -> dict:
    res = dict(res)
    res.pop("params")
    return res


def _families_worker(rank: int, world: int, spec: PlannerBenchSpec, runs: list,
                     out_dir: str) -> None:
    """``runs``: ``(family, policies, peer plan)`` in the interleaved order to measure."""
    from trainwright.run.harness import run_gpt_pipeline

    torch.set_num_threads(1)
    _warm_up(spec, world)
    out = [_slim(run_gpt_pipeline(spec.job(world, "1f1b"), policies=pol, peer_plan=peer))
           for _, pol, peer in runs]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def _measure_links() -> dict:
    from trainwright.dist.probe import measure_p2p

    small = measure_p2p(nbytes=64, repeats=20)
    big = measure_p2p(nbytes=4 * 2**20, repeats=5)
    return {"small": small.bandwidth[0][1], "big": big.bandwidth[0][1]}


def _spawn(fn, world: int, *args) -> list:
    from trainwright.dist.testing import run_workers

    with tempfile.TemporaryDirectory() as d:
        run_workers(fn, world, *args, d, timeout_s=1200)
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]


def _links(got: dict) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) from the ping-pong: one round = message + 4-byte ack."""
    latency = 64 / got["small"] / 2
    bandwidth = 1 / max(1 / got["big"] - 2 * latency / (4 * 2**20), 1e-12)
    return latency, bandwidth


def _budgets(spec: PlannerBenchSpec, peaks: list[int]) -> list[int]:
    """Stage 0 limited to ``limit_fraction`` of its keep peak; the others get room for it."""
    return [int(spec.limit_fraction * peaks[0])] + [p + peaks[0] for p in peaks[1:]]


def _plan(rows: list, spec: PlannerBenchSpec, stages: int, schedule: str, budgets: list[int],
          families: tuple):
    from trainwright.plan.devices import DeviceTopology
    from trainwright.plan.placement import Rules
    from trainwright.plan.planner import PlanRequest, make_plan

    bw = [[0.0 if i == j else 1e9 for j in range(stages)] for i in range(stages)]
    topo = DeviceTopology("loopback", [max(budgets)] * stages, bw, [1e9] * stages)
    req = PlanRequest(rows, schedule, stages, spec.micro_batches, topo, budget=budgets,
                      partition=spec.parts(stages),
                      rules=Rules(short_s=math.inf, long_s=math.inf, families=families))
    return make_plan(req)


def _layer_policies(plan) -> dict[int, str]:
    """Runtime per-layer policies of a plan (host tensor -> swap layer)."""
    from trainwright.pipeline.peer_setup import runtime_policies

    return runtime_policies(plan.to_dict())


def _peer_plan_json(plan) -> dict:
    from trainwright.pipeline.peer_setup import peer_plan_json

    return peer_plan_json(plan.to_dict())


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas else 0.0


# ---- big plans ----------------------------------------------------------------------------

def plan_175b(cold: bool = False) -> dict:
    """Profile (meta device) and plan GPT-3 175B on 128 x 8 NVSwitch GPUs, pp 64 x dp 16."""
    from trainwright.model.gpt_profile import gpt_profile
    from trainwright.plan.devices import cluster, preset
    from trainwright.plan.planner import PlanRequest, make_plan

    if not cold:  # import torch's meta/decomposition machinery first (a one-off cost)
        with torch.device("meta"):
            torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum()
    t0, c0 = time.perf_counter(), time.process_time()
    rows = gpt_profile(96, 12288, 96, 2048, 50257, 1, True, "bfloat16", 125e12, 900e9)
    topo = cluster(preset("nvswitch8", 80 * 10**9), 128, 25e9)
    pp, dp = 64, 16
    m = 1536 // dp
    grad = sum(x.param_bytes for x in rows) / pp
    req = PlanRequest(rows, "1f1b", pp, m, topo, state_factor=8.0, reserve=2 * 2**30,
                      latency_s=10e-6, sync_s=2 * (dp - 1) / dp * grad / 25e9)
    plan = make_plan(req)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "pp": pp, "dp": dp, "micro_batches": m, "fits": all(plan.to_dict()["fits"]),
            "predicted_step_s": plan.sim.step_s,
            "max_peak_gib": max(plan.sim.peak_bytes) / 2**30}


def _cold_175b() -> dict:
    """:func:`plan_175b` in a fresh process (torch imported, its meta machinery not yet)."""
    import subprocess
    import sys

    code = ("import json; from trainwright.bench.planner import plan_175b; "
            "print(json.dumps(plan_175b(cold=True)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def dgx1_table() -> list[dict]:
    """Predicted step time and per-GPU peak of a GPT on one DGX-1, with and without peer swap."""
    from trainwright.model.gpt_profile import gpt_profile
    from trainwright.plan.devices import preset
    from trainwright.plan.planner import PlanRequest, make_plan

    rows = gpt_profile(24, 2048, 16, 2048, 50257, 12, True, "bfloat16", 125e12, 900e9)
    topo = preset("dgx1", 32 * 2**30)
    out = []
    for peer in (False, True):
        req = PlanRequest(rows, "1f1b", 8, 16, topo, state_factor=8.0, reserve=2 * 2**30,
                          partition=[4, 3, 3, 3, 3, 3, 3, 4], peer_swap=peer,
                          latency_s=10e-6)
        plan = make_plan(req)
        d = plan.to_dict()
        out.append({"model": "GPT 1.3B (24 x d2048, ctx 2048, bf16), 16 micro-batches of 12, "
                             "1F1B, 8 stages [embed+3, 3 x6, 3+head], fp32 Adam state",
                    "peer_swap": peer, "mapping": d["mapping"],
                    "predicted_step_s": round(plan.sim.step_s, 4),
                    "all_keep_step_s": round(plan.keep_sim.step_s, 4),
                    "all_keep_peak_gib_per_gpu": [round(b / 2**30, 2)
                                                  for b in plan.keep_sim.peak_bytes],
                    "peak_gib_per_gpu": [round(b / 2**30, 2) for b in plan.sim.peak_bytes],
                    "budget_gib_per_gpu": [round(b / 2**30, 2) for b in d["budgets"]],
                    "fits": d["fits"], "policy_counts": d["policy_counts"]})
    return out


# ---- the benchmark ----------------------------------------------------------------------

def families(spec: PlannerBenchSpec, tensor_rows: list, budgets: list[int],
             repeats: int) -> dict:
    """Peer swap, host swap and recompute alone under ``budgets`` (4 stages, 1F1B), in
    ``repeats`` rounds (ABBA order) in one process group (question 2)."""
    stages = max(spec.stage_counts)
    plans = {f: _plan(tensor_rows, spec, stages, "1f1b", budgets, (f,))
             for f in ("peer", "host", "recompute")}
    order = [(f, _layer_policies(plans[f]), _peer_plan_json(plans[f]) if f == "peer" else None)
             for r in range(repeats) for f in round_order(list(plans), r)]
    got = _spawn(_families_worker, stages, spec, order)
    fams: dict[str, list] = {f: [] for f in plans}
    for j, (fam, _, _) in enumerate(order):
        step, peaks = measured([r[j] for r in got], spec.warmup)
        fams[fam].append({"step_s": step, "peaks": peaks})
    rows = {}
    for fam, runs in fams.items():
        rows[fam] = {
            "step_s": statistics.median(r["step_s"] for r in runs),
            "step_s_per_repeat": [round(r["step_s"], 4) for r in runs],
            "peak_bytes_per_stage": runs[-1]["peaks"],
            "fits": all(p <= b for p, b in zip(runs[-1]["peaks"], budgets, strict=True)),
            "policy_counts": plans[fam].to_dict()["policy_counts"]}
    best_other = [min(h["step_s"], r["step_s"])
                  for h, r in zip(fams["host"], fams["recompute"], strict=True)]
    pr = paired([r["step_s"] for r in fams["peer"]], best_other)
    return {"peer_swap_step_s": round(rows["peer"]["step_s"], 4),
            "host_swap_step_s": round(rows["host"]["step_s"], 4),
            "recompute_step_s": round(rows["recompute"]["step_s"], 4),
            "family_limit_bytes": budgets, "families": rows,
            "peer_vs_best_other": pr["ratio"],
            "peer_vs_best_other_paired_ratios": pr["paired_ratios"],
            "peer_vs_best_other_spread": pr["ratio_spread"]}


def _family_budgets(spec: PlannerBenchSpec, tensor_rows: list, forecast: ForecastSpec,
                    profile: dict) -> list[int]:
    """Budgets of question 2 from the forecast's predicted all-keep peaks (4 stages, 1F1B)."""
    import copy

    from trainwright.bench.forecast_model import Profile, predict

    rows = copy.deepcopy(tensor_rows)
    prof = Profile(rows, [0.0] * len(rows), profile["latency_s"], profile["bandwidth_Bps"],
                   profile["host_bandwidth_Bps"], 0.0)
    keep = predict(prof, forecast, max(spec.stage_counts), spec.micro_batches, "1f1b", "keep")
    return _budgets(spec, keep["peak_bytes"])


def run(spec: PlannerBenchSpec, repeats: int = 3, big: bool = True,
        forecast: ForecastSpec | None = None, with_families: bool = True) -> dict:
    """Every measurement of the module docstring; returns the JSON."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from trainwright.observe.tensor_profile import profile_tensors
    from trainwright.run.harness import job_batch, job_layers

    forecast = forecast or ForecastSpec(n_blocks=spec.n_blocks, d_model=spec.d_model,
                                        n_heads=spec.n_heads, context=spec.context,
                                        micro_batch_size=spec.micro_batch_size)
    out: dict = {"benchmark": "planner"}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("bench planner", total=None)

        def say(s: str, done: int | None = None, total: int | None = None) -> None:
            bar.update(task, description=f"bench planner: {s}", completed=done, total=total)

        got = run_forecast(forecast, progress=say)
        out.update(got)
        if with_families:
            say("peer / host / recompute alone")
            job0 = spec.job(1, "1f1b")
            x, y = job_batch(job0, 0)
            n = spec.micro_batch_size
            rows = profile_tensors([(f"layer{i}", m) for i, m in enumerate(job_layers(job0))],
                                   x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(
                                       o.flatten(0, 1), t.flatten()))
            budgets = _family_budgets(spec, rows, forecast, got["profile"])
            out.update(families(spec, rows, budgets, repeats))
        if big:
            say("175B plan, DGX-1 table")
            warm = plan_175b()
            table = dgx1_table()
    out["question"] = "forecast: " + got["question"] + (
        " families: is peer swap no slower than the faster of host swap and recompute?"
        if with_families else "")
    out["spec"] = asdict(spec)
    if big:
        cold = _cold_175b()
        out.update({"plan_175b_1024_s": round(warm["wall_s"], 3),
                    "plan_175b_1024_cold_s": round(cold["wall_s"], 3),
                    "plan_175b_1024_cpu_s": round(warm["cpu_s"], 3),
                    "plan_175b_1024": {**warm, "note": "meta machinery imported beforehand"},
                    "dgx1_gpt": table})
    return out


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench planner [--repeats N] [--steps N]``.

    ``--repeats`` sets the rounds of the forecast's configurations (default 3,
    :attr:`ForecastSpec.repeats`: the sweep has 28, and with ``bench memory`` must finish
    within 40 minutes) and of the policy families (default 3) alike; ``--stages`` keeps
    the configurations of that depth.
    """
    spec = PlannerBenchSpec()
    forecast = ForecastSpec(n_blocks=spec.n_blocks, d_model=spec.d_model, n_heads=spec.n_heads,
                            context=spec.context, micro_batch_size=spec.micro_batch_size)
    if args.steps:
        spec.steps = forecast.steps = args.steps
    if args.stages:
        spec.stage_counts = [args.stages]
        forecast.configs = [c for c in forecast.configs if c[0] == args.stages]
    if args.repeats:
        forecast.repeats = args.repeats
    return run(spec, repeats=args.repeats or 3, forecast=forecast)
