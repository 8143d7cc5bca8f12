"""``trainwright bench memory``: fitting each stage under a limit, against what a user does.

Question: with every stage limited to half of the largest stage's unconstrained activation peak
(a GPT cut like a real transformer, attention and MLP as separate layers; 4 stages,
1F1B), does trainwright's plan fit by the meter, and how fast is it next to the fastest
``torch.utils.checkpoint`` rule a user would find that also fits?

Every row's per-stage peak comes from one instrument, the same for all rows:
:class:`~trainwright.bench.live_meter.LiveStorageMeter` (storages that each layer's
forward creates or receives, counted until freed; recomputation included), in a separate
short metered run per row (the meter's dispatch mode slows a step, so it never runs in a
timed round).

Rows (same model, weights, batches and runtime):

- ``keep``: no limit (gives the unconstrained peaks and the limit);
- ``plan_no_swap`` (headline): the exact planner with host swap priced out, so it can
  only choose which layers to recompute (on a CPU a "swap" is a memcpy into the same RAM
  and would prove nothing);
- ``plan_with_swap``: the exact planner with swap allowed (shown, not the headline);
- ``checkpoint_best``: the fastest checkpoint rule that fits, found by trying the rules
  a user would try (:func:`checkpoint_candidates`, per-stage rules included), each
  metered over at least 3 steps (the worst counts) and briefly timed; which one won is
  ``best_fitting_checkpoint``;
- ``checkpoint_all``: every layer checkpointed;
- ``deepspeed_checkpoint``, where DeepSpeed imports: DeepSpeed's activation checkpointing,
  ``deepspeed.checkpointing.checkpoint`` (set up with ``deepspeed.checkpointing.configure``:
  no partitioning, no CPU checkpointing), on the winning rule's layers less the embedding
  (:func:`deepspeed_layers`). That function is what a DeepSpeed pipeline user gets:
  ``PipelineModule(activation_checkpoint_interval=k)`` calls it on every group of ``k``
  layers (of the ``checkpointable_layers`` types), which can only express "every layer of
  these types"; the fewest-layers choice a user would make needs the function itself, and
  running it inside the same runtime keeps the meter and the rounds identical, so the row
  differs from ``checkpoint_best`` only in whose checkpoint recomputes (DeepSpeed's is
  reentrant and saves the layer's inputs). If it fails, its row holds the error and the
  rounds are run again without it.

Prediction: the footprint model's per-stage peaks for the planned rows
(:func:`~trainwright.pipeline.budget.predicted_footprints`, from one profile) against the
meter: ``predict_peak_error_median/max`` (device bytes) and ``predict_host_error_*`` (host
copies). The headline ratio is reported only when ``all_planned_rows_fit``.

Timing: ``repeats`` rounds, systems in ABBA order (:mod:`~trainwright.bench.paired`);
the headline is the median over rounds of ``plan_no_swap / checkpoint_best`` measured in
the same round; ``ratio_vs_deepspeed_checkpoint`` pairs ``plan_no_swap`` with
``deepspeed_checkpoint`` the same way (``..._paired``, ``..._spread``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import Progress

from trainwright.bench import deepspeed_peer, peers
from trainwright.bench.paired import (
    host_info,
    judged,
    paired,
    round_order,
    seconds,
    slowest_rank_step_s,
    spread,
)
from trainwright.config import Config, load_config

__all__ = ["MemoryBenchSpec", "checkpoint_candidates", "run", "main"]

FACTORY = 'model.factory="trainwright.bench.live_meter:bench_gpt"'
DEEPSPEED = "deepspeed_checkpoint"
"""The DeepSpeed activation checkpointing row (where DeepSpeed imports)."""


@dataclass(kw_only=True)
class MemoryBenchSpec:
    """GPT of ``n_blocks`` blocks cut into embed, attn/mlp pairs, head; 4 stages, 1F1B."""

    n_blocks: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    stages: int = 4
    micro_batches: int = 8
    micro_batch_size: int = 2
    lr: float = 0.01
    steps: int = 17
    warmup: int = 4
    """Steps metered (2 to ``warmup``: at least 3, the worst counts), dropped from timing."""
    search_steps: int = 3
    """Timed steps after the metered ones in the checkpoint search (which rule is fastest)."""
    seed: int = 0
    threads_per_rank: int = 1
    limit_fraction: float = 0.5
    split: list[int] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        """Layers of the cut model: embed, one attention and one MLP per block, head."""
        return 2 * self.n_blocks + 2

    def layer_split(self) -> list[int]:
        """Layers per stage, as even as possible."""
        n = self.n_layers
        return self.split or [n // self.stages + (s < n % self.stages)
                              for s in range(self.stages)]

    def layer_names(self) -> list[str]:
        """Names of the cut model's layers, in order."""
        return ["embed", *(f"{k}{i}" for i in range(self.n_blocks) for k in ("attn", "mlp")),
                "head"]


def checkpoint_candidates(spec: MemoryBenchSpec) -> list[tuple[str, list[int]]]:
    """Sets of layers a user would try to checkpoint, fewest layers first.

    Every k-th layer (k = 1..4), the first n layers, only the MLP layers, only the
    attention layers, the first n MLP layers, the first n attention layers, and per stage
    rules: each stage's own first n layers. Duplicates (the same set under two rules) keep
    the first rule's name.
    """
    names = spec.layer_names()
    split = spec.layer_split()
    starts = [sum(split[:s]) for s in range(len(split))]
    n = len(names)
    mlp = [i for i, x in enumerate(names) if x.startswith("mlp")]
    attn = [i for i, x in enumerate(names) if x.startswith("attn")]
    cands = [(f"every {k}th layer" if k > 1 else "every layer", list(range(0, n, k)))
             for k in (1, 2, 3, 4)]
    cands += [(f"first {j} layers", list(range(j))) for j in range(1, n)]
    cands += [("all MLP layers", mlp), ("all attention layers", attn)]
    cands += [(f"first {j} MLP layers", mlp[:j]) for j in range(1, len(mlp))]
    cands += [(f"first {j} attention layers", attn[:j]) for j in range(1, len(attn))]
    cands += [(f"each stage's first {j} layers",
               [a + i for a, k in zip(starts, split, strict=True) for i in range(min(j, k))])
              for j in range(1, max(split) + 1)]
    seen, out = set(), []
    for name, layers in cands:
        if tuple(layers) not in seen:
            seen.add(tuple(layers))
            out.append((name, layers))
    return sorted(out, key=lambda c: len(c[1]))


def _config(spec: MemoryBenchSpec, run_dir: Path, extra: list[str], steps: int) -> Config:
    return load_config(None, [
        f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}", FACTORY,
        'data.factory="trainwright.bench.live_meter:bench_data"', "data.max_bytes=1000000",
        f"train.steps={steps}",
        f"train.batch_size={spec.micro_batches * spec.micro_batch_size}",
        f"train.micro_batches={spec.micro_batches}", "train.schedule=1f1b",
        "train.optimizer=sgd", f"train.lr={spec.lr}", f"train.seed={spec.seed}",
        f"parallel.pp={spec.stages}", f"parallel.partition={spec.layer_split()}",
        f"parallel.threads_per_rank={spec.threads_per_rank}", "run.report=false",
        "run.progress=false", "run.checkpoint_every=0", "run.trace_steps=0",
        f"run.profile_every={steps}", f'run.dir="{run_dir.parent}"',
        f'run.name="{run_dir.name}"', *extra,
    ])


def runs_worker(rank: int, world_size: int, master_port: int, spec: MemoryBenchSpec,
                out_path: str, *, runs: list) -> None:
    """One rank of trainwright running ``runs`` one after another in one process group.

    Each run is ``(name, extra config overrides, checkpointed layer indices, steps)``; its
    model is wrapped in the live-storage meter, which counts the first ``spec.warmup``
    steps only (the timed steps after them run unmetered). The run named
    :data:`DEEPSPEED` checkpoints with DeepSpeed's function, the others with torch's.
    """
    import torch
    import torch.distributed as dist

    from trainwright.bench.live_meter import reset_meter
    from trainwright.dist import collective as coll
    from trainwright.run.trainer import Trainer

    torch.set_num_threads(spec.threads_per_rank)
    peers.init_process_group(rank, world_size, master_port)
    out = []
    try:
        for j, (name, extra, checkpointed, steps) in enumerate(runs):
            os.environ.update({"TW_BENCH_SPLIT": "1", "TW_BENCH_METER": "1",
                               "TW_BENCH_METER_STEPS": str(spec.warmup),
                               "TW_BENCH_CHECKPOINT": ",".join(map(str, checkpointed)),
                               "TW_BENCH_CHECKPOINT_IMPL":
                                   "deepspeed" if name == DEEPSPEED else "torch"})
            m = reset_meter()
            run_dir = Path(out_path).parent / f"run{j}"
            cfg = _config(spec, run_dir, list(extra), steps)
            if rank == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
            coll.barrier()
            trainer = Trainer(cfg, run_dir)
            trainer.fit()
            m.stop_steps()
            trainer.close()
            coll.barrier()
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out.append(_run_record(name, rows, m.peak_bytes, rank, world_size, spec,
                                   m.peak_host_bytes))
    finally:
        dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(out))


def _run_record(name: str, rows: list, metered: int, rank: int, world: int,
                spec: MemoryBenchSpec, host: int = 0) -> dict:
    steps = [r for r in rows if r["kind"] == "step"]
    plans = [r for r in rows if r["kind"] == "memory_plan"]
    return {"name": name, "step_times_s": [r["step_time_s"] for r in steps],
            "losses": [r["loss"] for r in steps] if rank == world - 1 else None,
            "store_peak_bytes": max(r["stages"][rank]["activation_peak_bytes"] for r in steps),
            "metered_peak_bytes": metered, "metered_host_peak_bytes": host,
            "policies": {p["stage"]: [x["policy"] for x in p["layers"]] for p in plans}}


def _spawn_runs(spec: MemoryBenchSpec, runs: list) -> list[dict]:
    """``runs`` in one spawned process group; per run, one record per rank."""
    fn = functools.partial(runs_worker, runs=runs)
    got = peers.spawn_peer(fn, spec, world_size=spec.stages, timeout_s=3600)
    return [[g[j] for g in got] for j in range(len(runs))]


def _peaks(per_rank: list[dict]) -> list[int]:
    return [r["metered_peak_bytes"] for r in per_rank]



def search_checkpoint(spec: MemoryBenchSpec, limit: int) -> dict:
    """Meter every candidate rule (:func:`checkpoint_candidates`) in one process group, each
    over steps 2 to ``spec.warmup`` (the worst step counts), then time ``spec.search_steps``
    more; the **fastest** rule that fits every stage wins (ties: fewest layers)."""
    cands = checkpoint_candidates(spec)
    got = _spawn_runs(spec, [(name, (), layers, spec.warmup + spec.search_steps)
                             for name, layers in cands])
    tried = [{"rule": name, "layers": layers, "metered_peak_bytes_per_stage": _peaks(g),
              "step_s": round(slowest_rank_step_s(g, spec.warmup), 5),
              "fits": all(p <= limit for p in _peaks(g))}
             for (name, layers), g in zip(cands, got, strict=True)]
    fitting = [t for t in tried if t["fits"]]
    if not fitting:
        raise RuntimeError(f"no checkpoint rule fits the limit {limit}; tried {len(tried)}; "
                           f"raise limit_fraction")
    best = min(fitting, key=lambda t: (t["step_s"], len(t["layers"])))
    return {"rule": best["rule"], "layers": best["layers"], "tried": tried}


def deepspeed_layers(best: dict) -> list[int]:
    """The layers the DeepSpeed row checkpoints: the winning torch rule's, less the
    embedding (layer 0). DeepSpeed's checkpoint is reentrant: with integer token ids as its
    only input nothing in it requires grad, so the embedding would get no gradient (the
    reason DeepSpeed's ``PipelineModule`` lets a user restrict ``checkpointable_layers``)."""
    return [i for i in best["layers"] if i != 0]


def _timed_systems(spec: MemoryBenchSpec, limit: int, best: dict, ds: dict | None) -> dict:
    """name -> (config overrides, checkpointed layers) of every timed row."""
    lim = (f"memory.limit={limit}", "memory.planner=optimal")
    out = {"keep": ((), []),
           "plan_no_swap": ((*lim, "memory.host_bandwidth=1000.0"), []),  # swap priced out
           "plan_with_swap": (lim, []),
           "checkpoint_best": ((), best["layers"]),
           "checkpoint_all": ((), list(range(spec.n_layers)))}
    if ds and "error" not in ds:
        out[DEEPSPEED] = ((), ds["layers"])
    return out


def _rounds(spec: MemoryBenchSpec, systems: dict, repeats: int) -> dict[str, list]:
    """Every system ``repeats`` times in ABBA order, one process group: name -> runs."""
    order = [(name, *systems[name], spec.steps)
             for r in range(repeats) for name in round_order(list(systems), r)]
    got = _spawn_runs(spec, order)
    per: dict[str, list] = {n: [] for n in systems}
    for (name, *_), g in zip(order, got, strict=True):
        per[name].append(g)
    return per


def run(spec: MemoryBenchSpec, repeats: int = 5, progress=None,
        deepspeed: bool | None = None) -> dict:
    """Measure every row; see the module docstring. ``progress``: callback(str);
    ``deepspeed``: run the DeepSpeed row (default: where DeepSpeed imports)."""
    say = progress or (lambda _: None)
    say("keep (metered): the limit")
    unconstrained = _peaks(_spawn_runs(spec, [("keep", (), [], spec.warmup)])[0])
    limit = int(spec.limit_fraction * max(unconstrained))
    say(f"checkpoint search: {len(checkpoint_candidates(spec))} rules, metered")
    best = search_checkpoint(spec, limit)
    use_ds = deepspeed_peer.deepspeed_available() if deepspeed is None else deepspeed
    ds = {"layers": deepspeed_layers(best)} if use_ds else None
    systems = _timed_systems(spec, limit, best, ds)
    say(f"{repeats} rounds x {len(systems)} systems, ABBA order")
    try:
        per = _rounds(spec, systems, repeats)
    except Exception as exc:
        if DEEPSPEED not in systems:
            raise
        # the peer's failure is its row's result: the rounds again without it
        ds["error"] = f"{type(exc).__name__}: {exc}"[-800:]
        systems = _timed_systems(spec, limit, best, ds)
        say(f"deepspeed failed; {repeats} rounds x {len(systems)} systems, ABBA order")
        per = _rounds(spec, systems, repeats)
    say("footprint prediction of the planned rows")
    predicted = predict_planned(spec, limit, systems)
    return _result(spec, repeats, unconstrained, limit, best, systems, per, ds, predicted)


def predict_planned(spec: MemoryBenchSpec, limit: int, systems: dict) -> dict:
    """Per planned row, the footprint model's per-stage ``(device, host)`` peaks from one
    profile in this process (the rows' model: ``TW_BENCH_SPLIT=1``)."""
    import tempfile
    from unittest import mock

    from trainwright.model.build import build_layers
    from trainwright.pipeline.budget import predicted_footprints
    from trainwright.pipeline.profile import profile_model

    out, table = {}, None
    # the rows' model, in this process only for the profile (a test process runs on)
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {"TW_BENCH_SPLIT": "1"}):
        for name in ("plan_no_swap", "plan_with_swap"):
            cfg = _config(spec, Path(tmp) / name, list(systems[name][0]), spec.steps)
            if table is None:
                table = profile_model(cfg, build_layers(cfg))
            fps = predicted_footprints(cfg, table)
            out[name] = {"device": [f.activations for f in fps], "host": [f.host for f in fps]}
    return out


def _errors(predicted: dict, by: dict) -> dict:
    """``predict_peak_error_*`` (device) and ``predict_host_error_*`` over planned stages."""
    dev, host = [], []
    for name, p in predicted.items():
        row = by.get(name)
        if row is None or "error" in row:
            continue
        row["predicted_peak_bytes_per_stage"] = p["device"]
        row["predicted_host_peak_bytes_per_stage"] = p["host"]
        dev += [abs(a - m) / m for a, m in zip(p["device"], row["metered_peak_bytes_per_stage"],
                                               strict=True) if m]
        host += [abs(a - m) / m for a, m in zip(
            p["host"], row["metered_host_peak_bytes_per_stage"], strict=True) if m]
    out = {}
    for key, vals in (("predict_peak_error", dev), ("predict_host_error", host)):
        if vals:
            out[f"{key}_median"] = round(statistics.median(vals), 4)
            out[f"{key}_max"] = round(max(vals), 4)
    return out


def _row(name: str, system: tuple, runs: list, limit: int, warmup: int) -> dict:
    times = [slowest_rank_step_s(g, warmup) for g in runs]
    peaks = [max(p) for p in zip(*(_peaks(g) for g in runs), strict=True)]
    last = runs[-1]
    row = {"system": name, "step_s": round(statistics.median(times), 4),
           "step_s_per_round": [seconds(t) for t in times], "step_s_spread": spread(times),
           "metered_peak_bytes_per_stage": peaks,
           "metered_host_peak_bytes_per_stage": [
               max(r.get("metered_host_peak_bytes", 0) for r in rs)
               for rs in zip(*runs, strict=True)],
           "store_peak_bytes_per_stage": [r["store_peak_bytes"] for r in last],
           "fits": all(p <= limit for p in peaks),
           "losses": [round(v, 5) for v in next(r["losses"] for r in last if r["losses"])]}
    if system[1]:
        row["checkpointed_layers"] = list(system[1])
    if name.startswith("plan"):
        row["policies"] = {str(k): v for r in last for k, v in r["policies"].items()}
    return row


def _deepspeed_keys(times: dict, ds: dict | None) -> dict:
    """The DeepSpeed row's comparison keys, or why there are none."""
    if ds is None:
        return {"deepspeed": "not run: DeepSpeed is not installed (or was switched off)"}
    if "error" in ds:
        return {"deepspeed": "failed", "deepspeed_error": ds["error"]}
    pr = paired(times["plan_no_swap"], times[DEEPSPEED])
    return {"deepspeed": "deepspeed.checkpointing.checkpoint on the winning rule's layers "
                         "(embedding excepted), same runtime, meter and rounds",
            "ratio_vs_deepspeed_checkpoint": pr["ratio"],
            "ratio_vs_deepspeed_checkpoint_paired": pr["paired_ratios"],
            "ratio_vs_deepspeed_checkpoint_spread": pr["ratio_spread"]}


def _result(spec, repeats, unconstrained, limit, best, systems, per, ds=None,
            predicted=None) -> dict:
    rows = [_row(n, systems[n], per[n], limit, spec.warmup) for n in systems]
    if ds and "error" in ds:
        rows.append({"system": DEEPSPEED, "checkpointed_layers": ds["layers"],
                     "error": ds["error"]})
    by = {r["system"]: r for r in rows}
    times = {r["system"]: r["step_s_per_round"] for r in rows if "error" not in r}
    head = paired(times["plan_no_swap"], times["checkpoint_best"])
    fit = all(by[n]["fits"] for n in ("plan_no_swap", "plan_with_swap"))
    headline = ({"ratio_vs_best_fitting_checkpoint": head["ratio"],
                 "ratio_vs_best_fitting_checkpoint_judged": judged(head["paired_ratios"], 0.9)}
                if fit else
                {"ratio_vs_best_fitting_checkpoint": None,
                 "ratio_not_reported": "a planned row went over the limit by the meter: a "
                                       "ratio for a plan that does not fit means nothing"})
    return {
        "benchmark": "memory",
        "question": "with every stage limited to half of the largest stage's unconstrained "
                    "activation peak, does the plan without swap fit by the meter, and how "
                    "fast is it next to the fastest torch.utils.checkpoint rule a user "
                    "would find that fits?",
        "spec": asdict(spec), "repeats": repeats,
        "meter": "LiveStorageMeter (trainwright/bench/live_meter.py): storages each layer's "
                 "forward creates or receives, counted until freed, per stage; every row, "
                 "during its warm-up steps",
        "layer_names": spec.layer_names(),
        "unconstrained_peak_bytes": unconstrained, "limit_bytes": limit,
        "best_fitting_checkpoint": {"rule": best["rule"], "layers": best["layers"],
                                    "names": [spec.layer_names()[i] for i in best["layers"]]},
        "checkpoint_search": best["tried"],
        **_deepspeed_keys(times, ds),
        "rows": rows,
        "all_planned_rows_fit": fit,
        **_errors(predicted or {}, by),
        **headline,
        "paired_ratios": head["paired_ratios"], "ratio_spread": head["ratio_spread"],
        "with_swap_ratio_vs_best_fitting_checkpoint": paired(
            times["plan_with_swap"], times["checkpoint_best"])["ratio"],
        "ratio_vs_checkpoint_all": paired(times["plan_no_swap"],
                                          times["checkpoint_all"])["ratio"],
        "host": host_info(),
    }


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench memory [--repeats N] [--steps N]``; returns the result.

    At least 5 rounds (``--repeats`` below 5 is raised to 5). ``--device cuda``: the GPU
    variant, :mod:`~trainwright.bench.memory_cuda`.
    """
    if getattr(args, "device", "cpu") == "cuda":
        from trainwright.bench import memory_cuda
        return memory_cuda.main(args)
    spec = MemoryBenchSpec()
    if args.steps:
        spec.steps = args.steps
    with Progress(transient=True) as bar:
        task = bar.add_task("bench memory", total=None)
        return run(spec, repeats=max(5, args.repeats or 5),
                   progress=lambda s: bar.update(task, description=f"bench memory: {s}"))
