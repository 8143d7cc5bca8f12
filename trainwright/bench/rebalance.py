"""``trainwright bench rebalance``: live re-partitioning against the best static partition.

The workload is a small GPT whose first half of blocks has an MLP ``HEAVY_MLP_RATIO / 4``
times as wide (about 4x the cost of the other blocks), split evenly *by layer count* over
2 stages (``--stages 4`` works too), 1F1B, one compute thread per rank. Systems, one
after another in the same run:

* ``trainwright_rebalance``: starts on the even split with rebalancing on; the last stage
  detects the imbalance from the per-layer times, re-partitions, and layers migrate live.
  ``before`` = steps before the first migration (after warm-up), ``after`` = steps after
  the last one (after one settling step), ``migration_step_s`` = the slowest step that
  migrated, ``median_step_s`` = the median step after rebalancing.
* ``trainwright_best_static``: the partition with the least largest stage time, found by
  exhaustive search over every contiguous split of the *profiled* per-layer costs of the
  run above, trained from the start without rebalancing.
* ``deepspeed_pipeline_parameters``: DeepSpeed's ``PipelineModule`` with
  ``partition_method="parameters"`` (balances parameter counts) on the same layers.

``ratio_to_best`` = after / best static samples per second. With ``--repeats N`` the
systems run N interleaved rounds and every figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainwright.bench import peers
from trainwright.bench.ours import train_rank
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.config import Config, load_config
from trainwright.model.gpt import GPTConfig, gpt_layers

__all__ = ["RebalanceBenchSpec", "unbalanced_gpt", "best_static_partition", "run", "main"]

HEAVY_MLP_RATIO = 20
"""MLP width of the heavy blocks, in multiples of d_model (the others have 4)."""


def _layers(n_blocks: int, d_model: int, n_heads: int, context: int, seed: int) -> list:
    torch.manual_seed(seed)
    layers = gpt_layers(GPTConfig(vocab=256, context=context, d_model=d_model,
                                  n_heads=n_heads, n_blocks=n_blocks))
    for block in layers[1:1 + n_blocks // 2]:
        block.fc = nn.Linear(d_model, HEAVY_MLP_RATIO * d_model)
        block.out = nn.Linear(HEAVY_MLP_RATIO * d_model, d_model)
    return layers


def unbalanced_gpt(cfg: Config) -> list[nn.Module]:
    """``model.factory``: the GPT of ``cfg.model`` with heavy first-half blocks."""
    m = cfg.model
    return _layers(m.n_blocks, m.d_model, m.n_heads, m.context, cfg.train.seed)


@dataclass(kw_only=True)
class RebalanceBenchSpec(PipelineBenchSpec):
    """The unbalanced GPT, split evenly by layer count (peers read ``layers()``)."""

    n_blocks: int = 8
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    micro_batches: int = 8
    micro_batch_size: int = 2
    steps: int = 24
    warmup: int = 2
    static_steps: int = 12
    stages: int = 2

    def __post_init__(self) -> None:
        n = self.n_blocks + 2
        self.split = [n // self.stages + (s < n % self.stages) for s in range(self.stages)]

    def layers(self) -> list[nn.Module]:
        """The full model, initialised identically for every system."""
        return _layers(self.n_blocks, self.d_model, self.n_heads, self.context, self.seed)


def _config(spec: RebalanceBenchSpec, run_dir: Path, partition: list[int], steps: int,
            rebalance: bool) -> Config:
    return load_config(None, [
        'model.factory="trainwright.bench.rebalance:unbalanced_gpt"',
        f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}",
        "data.name=stdlib", "data.max_bytes=1000000",
        f"train.steps={steps}", f"train.batch_size={spec.batch_size}",
        f"train.micro_batches={spec.micro_batches}", "train.schedule=1f1b",
        "train.optimizer=sgd", f"train.lr={spec.lr}", f"train.seed={spec.seed}",
        f"parallel.pp={spec.stages}", f"parallel.partition={partition}",
        f"parallel.threads_per_rank={spec.threads_per_rank}",
        f"rebalance.enabled={'true' if rebalance else 'false'}", "rebalance.check_every=2",
        "rebalance.patience=2", "rebalance.cooldown=1", "rebalance.threshold_rel=0.1",
        "run.report=false", "run.progress=false", "run.checkpoint_every=0",
        "run.trace_steps=0", "run.profile_every=2",
        f'run.dir="{run_dir.parent}"', f'run.name="{run_dir.name}"',
    ])


def rebalance_worker(rank: int, world_size: int, master_port: int, spec: RebalanceBenchSpec,
                     out_path: str, *, partition: list[int] | None = None) -> None:
    """One rank of trainwright: rebalancing from the even split, or a fixed ``partition``."""
    static = partition is not None
    steps = spec.static_steps if static else spec.steps
    rec = train_rank(rank, world_size, master_port, spec.threads_per_rank,
                     lambda d: _config(spec, d, partition or spec.split, steps, not static),
                     out_path)
    Path(out_path).write_text(json.dumps({
        "rank": rank, "step_times_s": rec.step_times_s(),
        "repartitions": [r for r in rec.rows if r["kind"] == "repartition"],
        "decisions": [r for r in rec.rows if r["kind"] == "imbalance"],
        "layers": [r for r in rec.rows if r["kind"] == "layers"]}))


def best_static_partition(layer_times: list[float], stages: int) -> tuple[list[int], float]:
    """Exhaustive search: the contiguous split with the least largest stage time."""
    n, best = len(layer_times), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(layer_times[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or worst < best[1]:
            best = ([b - a for a, b in itertools.pairwise(bounds)], worst)
    return best


def _median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


def _ours_figures(ours: dict, spec: RebalanceBenchSpec) -> dict:
    """Before / after / migration figures of one rebalancing run (step times of rank 0)."""
    reps, times = ours["repartitions"], ours["step_times_s"]
    first = reps[0]["step"] if reps else len(times) + 1
    last = reps[-1]["step"] if reps else len(times)
    before = times[spec.warmup:first - 1]
    after = times[last + 1:]  # one settling step after the last migration
    return {"before_s": _median(before) if before else None,
            "after_s": _median(after) if after else None,
            "migration_step_s": max(times[r["step"] - 1] for r in reps) if reps else None,
            "steps_to_rebalance": last if reps else None,
            "partition_after": reps[-1]["new"] if reps else spec.split}


def run(spec: RebalanceBenchSpec, repeats: int = 1, deepspeed: bool | None = None) -> dict:
    """Run the systems ``repeats`` rounds, interleaved, and compare (see the module docstring).

    The best static partition comes from the first round's profile and stays fixed.
    """
    from rich.progress import Progress

    use_ds = peers.deepspeed_available() if deepspeed is None else deepspeed
    ours_runs, static_runs, ds_runs, best, layer_times = [], [], [], None, []
    with Progress(transient=True) as bar:
        task = bar.add_task("bench rebalance", total=repeats * (2 + use_ds))
        for _ in range(repeats):
            bar.update(task, description="bench rebalance: trainwright_rebalance")
            ours = peers.spawn_peer(rebalance_worker, spec, world_size=spec.stages)[0]
            ours_runs.append(ours)
            bar.advance(task)
            if best is None:
                last_layers = sorted(ours["layers"][-1]["layers"], key=lambda c: c["layer"])
                layer_times = [c["forward_s"] + c["backward_s"] for c in last_layers]
                best, _ = best_static_partition(layer_times, spec.stages)
            bar.update(task, description="bench rebalance: trainwright_best_static")
            static_runs.append(peers.spawn_peer(rebalance_worker, spec, world_size=spec.stages,
                                                worker_kwargs={"partition": best})[0])
            bar.advance(task)
            if use_ds:
                bar.update(task, description="bench rebalance: deepspeed parameters")
                ds_spec = RebalanceBenchSpec(**{k: getattr(spec, k) for k in (
                    "n_blocks", "d_model", "n_heads", "context", "micro_batches",
                    "micro_batch_size", "stages", "seed", "threads_per_rank", "lr")},
                    steps=spec.static_steps)
                ds_runs.append(peers.spawn_peer(peers.deepspeed_worker, ds_spec,
                                                world_size=spec.stages,
                                                worker_kwargs={"partition_method": "parameters"}))
                bar.advance(task)
    figs = [_ours_figures(o, spec) for o in ours_runs]
    b = spec.batch_size

    def med(key):
        vals = [f[key] for f in figs if f[key] is not None]
        return _median(vals) if vals else None

    after_s, before_s = med("after_s"), med("before_s")
    static_s = _median([_median(r["step_times_s"][spec.warmup:]) for r in static_runs])
    rows = [
        {"system": "trainwright_rebalance", "partition_before": spec.split,
         "partition_after": [f["partition_after"] for f in figs],
         "samples_per_s": round(b / after_s, 3) if after_s else None,
         "after_s_per_repeat": [f["after_s"] and round(f["after_s"], 4) for f in figs],
         "step_times_s": [[round(t, 4) for t in o["step_times_s"]] for o in ours_runs]},
        {"system": "trainwright_best_static", "partition": best,
         "samples_per_s": round(b / static_s, 3),
         "step_times_s": [[round(t, 4) for t in r["step_times_s"]] for r in static_runs]},
    ]
    result = {
        "benchmark": "rebalance",
        "question": "throughput after live re-partitioning vs the best static partition, "
                    "and the cost of the migration step",
        "spec": spec.to_dict(), "repeats": repeats, "rows": rows,
        "before_samples_per_s": round(b / before_s, 3) if before_s else None,
        "after_samples_per_s": rows[0]["samples_per_s"],
        "best_static_samples_per_s": rows[1]["samples_per_s"],
        "ratio_to_best": (round(rows[0]["samples_per_s"] / rows[1]["samples_per_s"], 3)
                          if rows[0]["samples_per_s"] else None),
        "steps_to_rebalance": med("steps_to_rebalance"),
        "repartitions": [o["repartitions"] for o in ours_runs],
        "decisions": [o["decisions"] for o in ours_runs],
        "migration_step_s": round(med("migration_step_s"), 4) if med("migration_step_s")
        else None,
        "median_step_s": round(after_s, 4) if after_s else None,
        "profiled_layer_times_ms": [round(1e3 * t, 3) for t in layer_times],
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__,
                 "python": platform.python_version()},
    }
    if ds_runs:
        ds_s = _median([_median(peers.step_time_s(r, spec.warmup)) for r in ds_runs])
        rows.append({"system": "deepspeed_pipeline_parameters",
                     "partition": ds_runs[0][0].get("partition"),
                     "samples_per_s": round(b / ds_s, 3),
                     "step_times_s": [[round(t, 4) for t in peers.step_time_s(r, 0)]
                                      for r in ds_runs]})
        result["deepspeed_parameters_samples_per_s"] = rows[-1]["samples_per_s"]
    if result["migration_step_s"] and result["median_step_s"]:
        result["migration_vs_median"] = round(result["migration_step_s"]
                                              / result["median_step_s"], 3)
    return result


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench rebalance [--stages N] [--steps N]``."""
    spec = RebalanceBenchSpec(stages=args.stages or 2)
    if args.steps:
        spec.steps = args.steps
    return run(spec, repeats=args.repeats)
