"""``trainwright bench pipeline``: our 1F1B against torch pipelining (and DeepSpeed), same work.

Every system trains :class:`~trainwright.bench.spec.PipelineBenchSpec` (8-block GPT, 2 stages
split 4 + 4 blocks, 8 micro-batches of 4, SGD) on the same batches from the same initial
weights, through the same spawn harness, one system after another, ``repeats`` rounds
interleaved so machine noise hits all systems alike. Our step time is the wall time between
consecutive step ends on rank 0 (everything included: data, gradient sync, metrics); the
peers' is barrier-to-optimizer-step on each rank, the slowest rank per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
from pathlib import Path

import torch

from trainwright.bench import peers
from trainwright.bench.ours import train_rank
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.config import Config, load_config

__all__ = ["trainwright_worker", "spec_config", "trace_bubble", "run", "main"]

log = logging.getLogger(__name__)


def spec_config(spec: PipelineBenchSpec, run_dir: Path) -> Config:
    """Our configuration for the benchmark workload."""
    return load_config(None, [
        "model.name=gpt", f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}",
        "data.name=stdlib", "data.max_bytes=1000000",
        f"train.steps={spec.steps}", f"train.batch_size={spec.batch_size}",
        f"train.micro_batches={spec.micro_batches}", "train.schedule=1f1b",
        "train.optimizer=sgd", f"train.lr={spec.lr}", f"train.seed={spec.seed}",
        f"parallel.pp={len(spec.split)}", f"parallel.partition={spec.split}",
        f"parallel.threads_per_rank={spec.threads_per_rank}",
        "run.report=false", "run.progress=false", "run.checkpoint_every=0",
        f"run.trace_steps={spec.steps}", f"run.profile_every={spec.steps}",
        f'run.dir="{run_dir.parent}"', f'run.name="{run_dir.name}"',
    ])


def trainwright_worker(rank: int, world_size: int, master_port: int, spec: PipelineBenchSpec,
                       out_path: str) -> None:
    """One rank of our 1F1B on the benchmark workload; writes the peers' result format."""
    rec = train_rank(rank, world_size, master_port, spec.threads_per_rank,
                     lambda run_dir: spec_config(spec, run_dir), out_path)
    Path(out_path).write_text(json.dumps({
        "system": "trainwright_1f1b", "rank": rank, "step_times_s": rec.step_times_s(),
        "losses": [r["loss"] for r in rec.steps] if rank == world_size - 1 else None,
        "bubble_fraction": trace_bubble(rec.run_dir / "trace.json", spec.warmup)}))


def trace_bubble(trace_path: Path, warmup: int) -> float:
    """Mean idle share of each rank's step span (first action to last), from trace.json."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans: dict[tuple[int, int], list] = {}
    for e in events:
        if e.get("ph") == "X" and e["args"]["step"] > warmup:
            spans.setdefault((e["pid"], e["args"]["step"]), []).append(e)
    fractions = []
    for evs in spans.values():
        begin = min(e["ts"] for e in evs)
        end = max(e["ts"] + e["dur"] for e in evs)
        busy = sum(e["dur"] for e in evs if e["args"]["kind"] in ("F", "B"))
        fractions.append(1 - busy / (end - begin))
    return statistics.fmean(fractions)


def _row(system: str, runs: list[list[dict]], spec: PipelineBenchSpec) -> dict:
    medians = [statistics.median(peers.step_time_s(r, spec.warmup)) for r in runs]
    med = statistics.median(medians)
    last = next(x for x in runs[-1] if x.get("losses"))
    return {"system": system, "step_ms_median": round(1e3 * med, 1),
            "step_ms_per_repeat": [round(1e3 * m, 1) for m in medians],
            "samples_per_s": round(spec.batch_size / med, 2),
            "losses_last_repeat": [round(v, 5) for v in last["losses"]]}


def run(spec: PipelineBenchSpec, repeats: int = 3, deepspeed: bool | None = None) -> dict:
    """Run every system ``repeats`` times, interleaved, and compare.

    Args:
        spec: the workload.
        repeats: rounds; each round runs every system once.
        deepspeed: include DeepSpeed (default: when it is installed).

    Returns:
        The benchmark result (see the module docstring); ``ratio`` is ours / torch's
        samples per second.
    """
    from rich.progress import Progress

    use_ds = peers.deepspeed_available() if deepspeed is None else deepspeed
    systems = {"trainwright_1f1b": trainwright_worker,
               "torch_pipelining_1f1b": peers.torch_pipelining_worker}
    if use_ds:
        systems["deepspeed_pipeline"] = peers.deepspeed_worker
    runs: dict[str, list] = {name: [] for name in systems}
    with Progress(transient=True) as bar:
        task = bar.add_task("bench pipeline", total=repeats * len(systems))
        for _ in range(repeats):
            for name, fn in systems.items():
                bar.update(task, description=f"bench pipeline: {name}")
                runs[name].append(peers.spawn_peer(fn, spec, world_size=len(spec.split)))
                bar.advance(task)
    rows = [_row(name, r, spec) for name, r in runs.items()]
    by = {r["system"]: r for r in rows}
    ours, torch_pp = by["trainwright_1f1b"], by["torch_pipelining_1f1b"]
    p, m = len(spec.split), spec.micro_batches
    result = {
        "benchmark": "pipeline",
        "question": "samples/s of trainwright 1F1B vs torch.distributed.pipelining "
                    "Schedule1F1B (and DeepSpeed PipelineEngine) on the same work",
        "spec": spec.to_dict(), "repeats": repeats, "rows": rows,
        "trainwright_samples_per_s": ours["samples_per_s"],
        "torch_pipelining_samples_per_s": torch_pp["samples_per_s"],
        "ratio": round(ours["samples_per_s"] / torch_pp["samples_per_s"], 3),
        "bubble_fraction": round(statistics.fmean(
            x["bubble_fraction"] for rs in runs["trainwright_1f1b"] for x in rs), 3),
        "bubble_bound": round((p - 1) / (m + p - 1), 3),
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__,
                 "python": platform.python_version()},
    }
    if use_ds:
        ds = by["deepspeed_pipeline"]
        result["deepspeed_samples_per_s"] = ds["samples_per_s"]
        result["ratio_vs_deepspeed"] = round(ours["samples_per_s"] / ds["samples_per_s"], 3)
    return result


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench pipeline [--repeats N] [--steps N]``; returns the result."""
    spec = PipelineBenchSpec()
    if args.steps:
        spec.steps = args.steps
    return run(spec, repeats=args.repeats)
