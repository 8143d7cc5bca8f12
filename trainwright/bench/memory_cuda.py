"""``trainwright bench memory --device cuda``: fitting each stage under a limit on a GPU.

Question: on one GPU, with every stage limited to half of the largest stage's
unconstrained activation peak, do trainwright's plans (with and without host swap) fit by
the CUDA allocator, and how fast are they next to the fastest ``torch.utils.checkpoint``
rule that also fits?

Workload (:class:`GpuMemorySpec`): the built-in GPT cut into embed, attention / MLP
layers and head (about 240 M parameters at the defaults, sequence 2,048, bf16 autocast),
two pipeline stages as two processes on the one GPU (gloo moves the activations through
host memory: NCCL refuses two ranks on one device), 1F1B.

The instrument is the CUDA allocator, not trainwright's accounting: per stage and step,
``torch.cuda.max_memory_allocated`` less what was allocated when the step began and the
stage's gradients (``cuda_activation_peak_bytes`` of the step rows, see
:class:`~trainwright.pipeline.runtime.StepStats`; the optimizer state the first step
creates is taken off), the worst over every step of the run, the first included. The plan
is made from a profile on the GPU that measures each layer's backward by the allocator
(the footprint's ``back_work``); should a step still exceed the limit, the stage plans
again against the limit less what the allocator held beyond the plan
(:meth:`~trainwright.pipeline.budget.MemoryBudget.check_allocator`): each row's
``first_step_allocator_peak_bytes_per_stage`` and ``allocator_excess_bytes_per_stage``
show whether that happened.

Rows: ``keep`` (gives the limit), ``plan_with_swap`` (the exact planner, host bandwidth
measured at start on the device, pinned buffers), ``plan_no_swap`` (swap priced out),
``checkpoint_best`` (the fastest rule of :func:`gpu_checkpoint_candidates` that fits,
each candidate run and measured by the allocator). Timing: ``repeats`` rounds in
alternating order, paired ratios with their 90 % interval (:mod:`~trainwright.bench.paired`).
Overlap: one extra short run of ``plan_with_swap`` under ``torch.profiler`` on stage 0
gives the share of host-copy kernel time that ran while a compute kernel ran.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainwright.bench import peers
from trainwright.bench.paired import (
    host_info,
    judged,
    paired,
    round_order,
    seconds,
    slowest_rank_step_s,
)
from trainwright.config import Config, load_config

log = logging.getLogger(__name__)

__all__ = ["GpuMemorySpec", "gpu_checkpoint_candidates", "run", "main"]


@dataclass(kw_only=True)
class GpuMemorySpec:
    """GPT cut into ``2 n_blocks + 2`` layers, ``stages`` processes on one GPU, 1F1B."""

    n_blocks: int = 12
    d_model: int = 1280
    n_heads: int = 20
    context: int = 2048
    stages: int = 2
    micro_batches: int = 8
    micro_batch_size: int = 2
    precision: str = "bf16"
    steps: int = 5
    warmup: int = 2
    repeats: int = 2
    limit_fraction: float = 0.5
    seed: int = 0

    @property
    def n_layers(self) -> int:
        return 2 * self.n_blocks + 2

    def layer_names(self) -> list[str]:
        return ["embed", *(f"{k}{i}" for i in range(self.n_blocks) for k in ("attn", "mlp")),
                "head"]

    def layer_split(self) -> list[int]:
        n = self.n_layers
        return [n // self.stages + (s < n % self.stages) for s in range(self.stages)]


def gpu_checkpoint_candidates(spec: GpuMemorySpec) -> list[tuple[str, list[int]]]:
    """Rules a user would try, a handful so the search fits the GPU check's minutes: every
    layer, every 2nd, all MLP, all attention, and per stage its own first half / all
    layers but the last (each stage's first layers hold the most in 1F1B)."""
    names = spec.layer_names()
    n = len(names)
    starts = [sum(spec.layer_split()[:s]) for s in range(spec.stages)]
    split = spec.layer_split()
    cands = [("every layer", list(range(n))), ("every 2nd layer", list(range(0, n, 2))),
             ("all MLP layers", [i for i, x in enumerate(names) if x.startswith("mlp")]),
             ("all attention layers", [i for i, x in enumerate(names) if x.startswith("attn")])]
    for frac, label in ((0.5, "first half"), (0.75, "first three quarters")):
        cands.append((f"each stage's {label}",
                      [s0 + j for s0, k in zip(starts, split, strict=True)
                       for j in range(max(1, int(k * frac)))]))
    seen, out = set(), []
    for name, layers in cands:
        if tuple(layers) not in seen:
            seen.add(tuple(layers))
            out.append((name, layers))
    return out


def _config(spec: GpuMemorySpec, run_dir: Path, extra: list[str], steps: int) -> Config:
    return load_config(None, [
        f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}",
        'model.factory="trainwright.bench.live_meter:bench_gpt"',
        'data.factory="trainwright.bench.live_meter:bench_data"', "data.max_bytes=2000000",
        f"train.steps={steps}", f"train.batch_size={spec.micro_batches * spec.micro_batch_size}",
        f"train.micro_batches={spec.micro_batches}", "train.schedule=1f1b",
        f'train.precision="{spec.precision}"', "train.optimizer=adamw", "train.lr=1e-4",
        f"train.seed={spec.seed}", f"parallel.pp={spec.stages}",
        f"parallel.partition={spec.layer_split()}", 'parallel.backend="gloo"',
        'parallel.device="cuda"', "run.report=false", "run.progress=false",
        "run.checkpoint_every=0", "run.trace_steps=0", f"run.profile_every={steps}",
        "observe.mfu=false",
        f'run.dir="{run_dir.parent}"', f'run.name="{run_dir.name}"', *extra,
    ])


def gpu_runs_worker(rank: int, world_size: int, master_port: int, spec: GpuMemorySpec,
                    out_path: str, *, runs: list) -> None:
    """One rank on the GPU, running ``runs`` (``(name, overrides, checkpointed, steps,
    profile)``) one after another in one process group; records each run's step rows."""
    import torch
    import torch.distributed as dist

    from trainwright.dist import collective as coll
    from trainwright.run.trainer import Trainer

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    peers.init_process_group(rank, world_size, master_port)
    out = []
    try:
        for j, (name, extra, checkpointed, steps, profile) in enumerate(runs):
            os.environ.update({"TW_BENCH_SPLIT": "1", "TW_BENCH_METER": "0",
                               "TW_BENCH_CHECKPOINT": ",".join(map(str, checkpointed)),
                               "TW_BENCH_CHECKPOINT_IMPL": "torch"})
            run_dir = Path(out_path).parent / f"run{j}"
            cfg = _config(spec, run_dir, list(extra), steps)
            if rank == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
            coll.barrier()
            trainer = Trainer(cfg, run_dir, device=device)
            overlap = None
            if profile and rank == 0:
                overlap = _profiled_fit(trainer)
            else:
                trainer.fit()
            trainer.close()
            torch.cuda.synchronize(device)
            coll.barrier()
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out.append(_record(name, rows, rank, overlap))
    finally:
        dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(out))


def _profiled_fit(trainer) -> dict:
    """``trainer.fit()`` under ``torch.profiler``; how much host-copy kernel time ran while
    a compute kernel ran on the device."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.fit()
    return copy_overlap(prof.events())


def copy_overlap(events) -> dict:
    """From profiler events: total device time of host<->device copies, and the share of it
    that overlapped a compute kernel (any other device event)."""
    from torch.autograd import DeviceType

    dev = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    copies = [(e.time_range.start, e.time_range.end) for e in dev
              if "Memcpy" in e.name and ("DtoH" in e.name or "HtoD" in e.name)]
    compute = sorted((e.time_range.start, e.time_range.end) for e in dev
                     if "Memcpy" not in e.name and "Memset" not in e.name)
    total = sum(b - a for a, b in copies)
    overlapped = 0.0
    for a, b in copies:
        covered, cur = 0.0, a
        for s, e in compute:
            if e <= cur:
                continue
            if s >= b:
                break
            lo, hi = max(s, cur), min(e, b)
            if hi > lo:
                covered += hi - lo
                cur = hi
        overlapped += covered
    return {"copy_us": round(total, 1), "copies": len(copies),
            "overlapped_us": round(overlapped, 1),
            "overlap_fraction": round(overlapped / total, 4) if total else None}


def _record(name: str, rows: list, rank: int, overlap: dict | None) -> dict:
    steps = [r for r in rows if r["kind"] == "step"]
    plans = [r for r in rows if r["kind"] == "memory_plan"]
    # every step, the first included (the runtime takes the optimizer state the first
    # optimizer step creates off its figure)
    mine = [r["stages"][rank] for r in steps]
    first = steps[0]["stages"][rank] if steps else {}
    return {"name": name, "step_times_s": [r["step_time_s"] for r in steps],
            "first_step_allocator_peak_bytes": first.get("cuda_activation_peak_bytes", -1),
            "replans": sum(p["stage"] == rank for p in plans),
            "allocator_excess_bytes": max((p.get("allocator_excess_bytes", 0) for p in plans
                                           if p["stage"] == rank), default=0),
            "losses": [r["loss"] for r in steps],
            "allocator_peak_bytes": max(s.get("cuda_activation_peak_bytes", -1) for s in mine),
            "allocator_total_peak_bytes": max(s.get("cuda_max_allocated_bytes", -1)
                                              for s in mine),
            "store_peak_bytes": max(s["activation_peak_bytes"] for s in mine),
            "host_bandwidth": next((p.get("host_bandwidth") for p in plans), None),
            "policies": {p["stage"]: [x["policy"] for x in p["layers"]] for p in plans},
            "overlap": overlap}


def _spawn(spec: GpuMemorySpec, runs: list) -> list[list[dict]]:
    fn = functools.partial(gpu_runs_worker, runs=runs)
    got = peers.spawn_peer(fn, spec, world_size=spec.stages, timeout_s=1800)
    return [[g[j] for g in got] for j in range(len(runs))]


def _peaks(per_rank: list[dict]) -> list[int]:
    return [r["allocator_peak_bytes"] for r in per_rank]



def run(spec: GpuMemorySpec, progress=None) -> dict:
    """Measure every row (module docstring); ``progress``: callback(str)."""
    say = progress or (lambda _: None)
    t0 = time.monotonic()
    say("keep: the unconstrained peaks")
    unconstrained = _peaks(_spawn(spec, [("keep", (), [], spec.warmup + 1, False)])[0])
    limit = int(spec.limit_fraction * max(unconstrained))
    cands = gpu_checkpoint_candidates(spec)
    say(f"checkpoint search: {len(cands)} rules, each over {spec.steps} steps (as timed)")
    got = _spawn(spec, [(n, (), layers, spec.steps, False) for n, layers in cands])
    tried = [{"rule": n, "layers": layers, "allocator_peak_bytes_per_stage": _peaks(g),
              "step_s": seconds(slowest_rank_step_s(g, spec.warmup)),
              "fits": all(p <= limit for p in _peaks(g))}
             for (n, layers), g in zip(cands, got, strict=True)]
    fitting = [t for t in tried if t["fits"]]
    best = min(fitting, key=lambda t: t["step_s"]) if fitting else None
    lim = (f"memory.limit={limit}", "memory.planner=optimal")
    systems = {"keep": ((), []), "plan_with_swap": (lim, []),
               "plan_no_swap": ((*lim, "memory.host_bandwidth=1000.0"), [])}
    if best:
        systems["checkpoint_best"] = ((), best["layers"])
    say(f"{spec.repeats} rounds x {len(systems)} systems, alternating order")
    order = [(n, *systems[n], spec.steps, False)
             for r in range(spec.repeats) for n in round_order(list(systems), r)]
    order.append(("plan_with_swap", lim, [], spec.warmup + 1, True))  # profiled, untimed
    got = _spawn(spec, order)
    per: dict[str, list] = {n: [] for n in systems}
    for (name, *_rest), g in zip(order[:-1], got[:-1], strict=True):
        per[name].append(g)
    return _result(spec, unconstrained, limit, tried, best, systems, per, got[-1],
                   time.monotonic() - t0)


def _result(spec, unconstrained, limit, tried, best, systems, per, profiled, wall) -> dict:
    rows = []
    for name in systems:
        runs = per[name]
        peaks = [max(p) for p in zip(*(_peaks(g) for g in runs), strict=True)]
        rows.append({"system": name,
                     "step_s_per_round": [seconds(slowest_rank_step_s(g, spec.warmup))
                                          for g in runs],
                     "allocator_peak_bytes_per_stage": peaks,
                     "allocator_total_peak_bytes_per_stage": [
                         max(r["allocator_total_peak_bytes"] for r in col)
                         for col in zip(*runs, strict=True)],
                     "store_peak_bytes_per_stage": [r["store_peak_bytes"] for r in runs[-1]],
                     "first_step_allocator_peak_bytes_per_stage": [
                         r["first_step_allocator_peak_bytes"] for r in runs[-1]],
                     "allocator_excess_bytes_per_stage": [r["allocator_excess_bytes"]
                                                          for r in runs[-1]],
                     "plans_per_stage": [r["replans"] for r in runs[-1]],
                     "fits": all(p <= limit for p in peaks),
                     "policies": {str(k): v for r in runs[-1]
                                  for k, v in r["policies"].items()},
                     "host_bandwidth": next((r["host_bandwidth"] for r in runs[-1]
                                             if r["host_bandwidth"]), None),
                     "losses": [round(v, 5) for v in runs[-1][-1]["losses"] if v is not None]})
        rows[-1]["step_s"] = seconds(statistics.median(rows[-1]["step_s_per_round"]))
    by = {r["system"]: r for r in rows}
    out = {
        "benchmark": "memory", "device": "cuda",
        "question": "on one GPU, with every stage limited to half of the largest stage's "
                    "unconstrained activation peak, do the plans fit by the CUDA allocator, "
                    "and how fast is the plan without swap next to the fastest fitting "
                    "torch.utils.checkpoint rule?",
        "spec": asdict(spec), "layer_names": spec.layer_names(),
        "instrument": "CUDA allocator: max_memory_allocated over each step less the bytes "
                      "allocated at its start, the stage's gradients and the optimizer "
                      "state the first step creates; worst step, the first included",
        "unconstrained_peak_bytes": unconstrained, "limit_bytes": limit,
        "checkpoint_search": tried,
        "best_fitting_checkpoint": ({"rule": best["rule"], "layers": best["layers"]}
                                    if best else None),
        "rows": rows,
        "every_stage_within_limit": all(by[n]["fits"] for n in ("plan_with_swap",
                                                                 "plan_no_swap")),
        "swap_copy_overlap": profiled[0]["overlap"],
        "wall_s": round(wall, 1), "host": host_info(),
    }
    if best:
        for key, name in (("ratio_vs_best_fitting_checkpoint", "plan_no_swap"),
                          ("with_swap_ratio_vs_best_fitting_checkpoint", "plan_with_swap")):
            pr = paired(by[name]["step_s_per_round"], by["checkpoint_best"]["step_s_per_round"])
            out[key] = pr["ratio"]
            out[key + "_judged"] = judged(pr["paired_ratios"], 0.9)
    return out


def main(args: argparse.Namespace) -> dict:
    """CLI entry for ``--device cuda``: ``--repeats``, ``--steps`` and ``--spec KEY=VALUE``
    change the workload."""
    from rich.progress import Progress

    from trainwright.bench.spec_overrides import spec_overrides

    spec = GpuMemorySpec()
    spec = GpuMemorySpec(**spec_overrides("memory --device cuda", spec,
                                          getattr(args, "spec", None)))
    if args.repeats:
        spec.repeats = args.repeats
    if args.steps:
        spec.steps = args.steps
    t0 = time.monotonic()

    def say(bar, task, what: str) -> None:
        bar.update(task, description=f"bench memory (cuda): {what}")
        log.info("[%6.1f s] bench memory (cuda): %s", time.monotonic() - t0, what)

    with Progress(transient=True) as bar:
        task = bar.add_task("bench memory --device cuda", total=None)
        return run(spec, progress=lambda s: say(bar, task, s))
