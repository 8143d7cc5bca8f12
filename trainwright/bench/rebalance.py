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

The systems run ``--repeats N`` rounds, each in alternating (ABBA) order
(:mod:`trainwright.bench.paired`). ``paired_ratios`` holds, per round, ``after`` samples/s
over best static samples/s, both from that round; the headline ``ratio_to_best`` is their
median, with ``ratio_spread``. End to end (``end_to_end_vs_best_static``, target >= 0.9):
the time to finish the same steps from the unbalanced start, detection and migration
included, against the best static partition trained from step 0 (and against DeepSpeed's
partition), paired per round. DeepSpeed runs unmetered, as every system does. Where
DeepSpeed is installed its row runs in the same rounds and
``ratio_vs_deepspeed_parameters`` is paired the same way; a DeepSpeed failure is recorded
as the row's ``error`` (and ``deepspeed_error``), not raised.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainwright.bench import deepspeed_peer, peers
from trainwright.bench.ours import train_rank
from trainwright.bench.paired import host_info, judged, paired, round_order, seconds
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.config import Config, load_config
from trainwright.model.gpt import GPTConfig, gpt_layers

__all__ = ["RebalanceBenchSpec", "unbalanced_gpt", "best_static_partition", "run", "main"]

SYSTEMS = ("trainwright_rebalance", "trainwright_best_static", "deepspeed_pipeline_parameters")
"""The compared systems, in round 0's order (``round_order`` alternates it)."""

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
    static_steps: int = 17
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
    """Before / after / migration figures of one rebalancing run (step times of rank 0).

    ``after_s`` is the median step after the last migration (after one settling step);
    where the run never migrated it is the median after warm-up: what the system ran at.
    """
    reps, times = ours["repartitions"], ours["step_times_s"]
    first = reps[0]["step"] if reps else len(times) + 1
    last = reps[-1]["step"] if reps else len(times)
    before = times[spec.warmup:first - 1]
    after = times[last + 1:] if reps else times[spec.warmup:]  # one settling step
    return {"before_s": _median(before) if before else None,
            "after_s": _median(after) if after else None,
            "migration_step_s": max(times[r["step"] - 1] for r in reps) if reps else None,
            "steps_to_rebalance": last if reps else None,
            "partition_after": reps[-1]["new"] if reps else spec.split}


def _deepspeed_spec(spec: RebalanceBenchSpec) -> RebalanceBenchSpec:
    return RebalanceBenchSpec(**{k: getattr(spec, k) for k in (
        "n_blocks", "d_model", "n_heads", "context", "micro_batches", "micro_batch_size",
        "stages", "seed", "threads_per_rank", "lr", "warmup")}, steps=spec.static_steps)


def _run_system(name: str, spec: RebalanceBenchSpec, best: list[int] | None):
    """One run of system ``name``: rank 0's result (ours) or every rank's (DeepSpeed)."""
    if name == SYSTEMS[0]:
        return peers.spawn_peer(rebalance_worker, spec, world_size=spec.stages)[0]
    if name == SYSTEMS[1]:
        return peers.spawn_peer(rebalance_worker, spec, world_size=spec.stages,
                                worker_kwargs={"partition": best})[0]
    try:
        return peers.spawn_peer(deepspeed_peer.deepspeed_worker, _deepspeed_spec(spec),
                                world_size=spec.stages,
                                worker_kwargs={"partition_method": "parameters"})
    except Exception as exc:  # a peer that fails is reported, not fatal to the bench
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _rounds(spec: RebalanceBenchSpec, repeats: int, systems: list[str]) -> tuple[dict, list]:
    """Every system once per round, in ABBA order; the best static split from round 0.

    Round 0 runs ``trainwright_rebalance`` first (``round_order`` keeps the listed order
    in even rounds), so its profile fixes the best static partition for every round.
    """
    from rich.progress import Progress

    runs: dict[str, list] = {name: [None] * repeats for name in systems}
    best, layer_times = None, []
    with Progress(transient=True) as bar:
        task = bar.add_task("bench rebalance", total=repeats * len(systems))
        for r in range(repeats):
            for name in round_order(systems, r):
                bar.update(task, description=f"bench rebalance: round {r + 1} {name}")
                runs[name][r] = _run_system(name, spec, best)
                if best is None and name == SYSTEMS[0]:
                    last = sorted(runs[name][r]["layers"][-1]["layers"],
                                  key=lambda c: c["layer"])
                    layer_times = [c["forward_s"] + c["backward_s"] for c in last]
                    best, _ = best_static_partition(layer_times, spec.stages)
                bar.advance(task)
    return runs, [best, layer_times]


def _deepspeed_row(ds_runs: list, spec: RebalanceBenchSpec, after: list, kept: list) -> tuple:
    """DeepSpeed's row and the paired ratio of ours to it over the ``kept`` rounds."""
    errors = [r["error"] for r in ds_runs if isinstance(r, dict)]
    if errors:
        return {"system": SYSTEMS[2], "error": errors[0]}, None
    per_round = [_median(peers.step_time_s(r, spec.warmup)) for r in ds_runs]
    row = {"system": SYSTEMS[2], "partition": ds_runs[0][0].get("partition"),
           "samples_per_s": round(spec.batch_size / _median(per_round), 3),
           "step_s_per_round": [seconds(t) for t in per_round],
           "step_times_s": [[round(t, 4) for t in peers.step_time_s(r, 0)] for r in ds_runs]}
    if not kept:
        return row, {"paired_ratios": [], "ratio": None, "ratio_spread": None}
    return row, paired([per_round[i] for i in kept], [after[i] for i in kept])


def _rows(spec, figs, ours_runs, static_runs, after, static, kept, best) -> list[dict]:
    """The rows of trainwright rebalancing and of the best static partition."""
    b = spec.batch_size
    return [
        {"system": SYSTEMS[0], "partition_before": spec.split,
         "partition_after": [f["partition_after"] for f in figs],
         "samples_per_s": round(b / _median([after[i] for i in kept]), 3) if kept else None,
         "after_s_per_round": [a and seconds(a) for a in after],
         "step_times_s": [[round(t, 4) for t in o["step_times_s"]] for o in ours_runs]},
        {"system": SYSTEMS[1], "partition": best,
         "samples_per_s": round(b / _median(static), 3),
         "step_s_per_round": [seconds(t) for t in static],
         "step_times_s": [[round(t, 4) for t in r["step_times_s"]] for r in static_runs]},
    ]


def run(spec: RebalanceBenchSpec, repeats: int = 1, deepspeed: bool | None = None) -> dict:
    """Run the systems ``repeats`` paired rounds in ABBA order and compare them.

    Per round: ``paired_ratios`` = samples/s of ``trainwright_rebalance`` after its last
    migration over samples/s of the best static partition, both measured in that round;
    the headline ``ratio_to_best`` is their median (see :mod:`trainwright.bench.paired`).
    """
    use_ds = deepspeed_peer.deepspeed_available() if deepspeed is None else deepspeed
    systems = list(SYSTEMS[:2 + bool(use_ds)])
    runs, (best, layer_times) = _rounds(spec, repeats, systems)
    ours_runs, static_runs = runs[SYSTEMS[0]], runs[SYSTEMS[1]]
    figs = [_ours_figures(o, spec) for o in ours_runs]
    b = spec.batch_size
    after = [f["after_s"] for f in figs]
    static = [_median(r["step_times_s"][spec.warmup:]) for r in static_runs]
    # a round whose last migration left no settled step has no "after": it is left out of
    # the pairing and counted, never filled in
    kept = [i for i, a in enumerate(after) if a is not None]
    head = (paired([static[i] for i in kept], [after[i] for i in kept]) if kept else
            {"paired_ratios": [], "ratio": None, "ratio_spread": None})
    # (static / after step time = after / static samples per second)

    def med(key):
        vals = [f[key] for f in figs if f[key] is not None]
        return _median(vals) if vals else None

    rows = _rows(spec, figs, ours_runs, static_runs, after, static, kept, best)
    before_s, migration = med("before_s"), med("migration_step_s")
    result = {
        "benchmark": "rebalance",
        "question": "throughput after live re-partitioning vs the best static partition "
                    "(paired per round, ABBA order), and the cost of the migration step",
        "spec": spec.to_dict(), "repeats": repeats, "round_orders": [
            round_order(systems, r) for r in range(repeats)], "rows": rows,
        "before_samples_per_s": round(b / before_s, 3) if before_s else None,
        "after_samples_per_s": rows[0]["samples_per_s"],
        "best_static_samples_per_s": rows[1]["samples_per_s"],
        "paired_ratios": head["paired_ratios"], "ratio_to_best": head["ratio"],
        "ratio_spread": head["ratio_spread"], "paired_rounds": kept,
        "rounds_without_settled_steps": repeats - len(kept),
        "steps_to_rebalance": med("steps_to_rebalance"),
        "repartitions": [o["repartitions"] for o in ours_runs],
        "decisions": [o["decisions"] for o in ours_runs],
        "migration_step_s": round(migration, 4) if migration else None,
        "median_step_s": round(_median([after[i] for i in kept]), 4) if kept else None,
        "profiled_layer_times_ms": [round(1e3 * t, 3) for t in layer_times],
        "host": host_info(),
    }
    result.update(_end_to_end(spec, ours_runs, static_runs,
                              runs[SYSTEMS[2]] if use_ds else None))
    if use_ds:
        _add_deepspeed(result, *_deepspeed_row(runs[SYSTEMS[2]], spec, after, kept))
    if result["migration_step_s"] and result["median_step_s"]:
        result["migration_vs_median"] = round(result["migration_step_s"]
                                              / result["median_step_s"], 3)
    return result


def _end_to_end(spec: RebalanceBenchSpec, ours_runs: list, static_runs: list,
                ds_runs: list | None) -> dict:
    """Time to finish the same ``N`` steps after warm-up, detection and migration included:
    per round, the best static partition's (and DeepSpeed's) time over ours, as a
    throughput ratio (>= 0.9 is the target against the best static partition).
    ``N`` is the steps every system ran after warm-up (the static runs are the shorter)."""
    w = spec.warmup
    n = min(len(r["step_times_s"]) for r in [*ours_runs, *static_runs]) - w
    ours = [sum(r["step_times_s"][w:w + n]) for r in ours_runs]
    static = [sum(r["step_times_s"][w:w + n]) for r in static_runs]
    pr = paired(static, ours)
    out = {"end_to_end_steps": n,
           "end_to_end_s_per_round": {"ours": [seconds(t) for t in ours],
                                      "best_static": [seconds(t) for t in static]},
           "end_to_end_vs_best_static": pr["ratio"],
           "end_to_end_vs_best_static_judged": judged(pr["paired_ratios"], 0.9,
                                                      at_most=False)}
    if ds_runs and not any(isinstance(r, dict) and "error" in r for r in ds_runs):
        ds = [sum(peers.step_time_s(r, w)[:n]) for r in ds_runs]
        out["end_to_end_s_per_round"]["deepspeed_parameters"] = [seconds(t) for t in ds]
        out["end_to_end_vs_deepspeed_parameters"] = paired(ds, ours)["ratio"]
    return out


def _add_deepspeed(result: dict, row: dict, ds_pair: dict | None) -> None:
    """DeepSpeed's row and paired figures into ``result``, or its error."""
    result["rows"].append(row)
    if ds_pair is None:
        result["deepspeed_error"] = row["error"]
        return
    result["deepspeed_parameters_samples_per_s"] = row["samples_per_s"]
    result["deepspeed_paired_ratios"] = ds_pair["paired_ratios"]
    result["ratio_vs_deepspeed_parameters"] = ds_pair["ratio"]
    result["ratio_vs_deepspeed_parameters_spread"] = ds_pair["ratio_spread"]


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench rebalance [--stages N] [--steps N]``."""
    spec = RebalanceBenchSpec(stages=args.stages or 2)
    if args.steps:
        spec.steps = args.steps
    return run(spec, repeats=args.repeats or 3)
