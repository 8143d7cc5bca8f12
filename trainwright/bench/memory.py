"""``trainwright bench memory``: fitting each stage under a limit, and what it costs.

Question: with every stage limited to half of the first stage's unconstrained activation
peak (small GPT, 4 stages, 1F1B, 8 micro-batches), do the per-layer policies keep every
stage under the limit, and how much slower is that than recomputing every layer?

Rows (same model, weights, batches and runtime unless noted):

- ``keep``: no limit (gives the unconstrained peaks and the limit);
- ``greedy`` / ``optimal``: trainwright's planners under the limit;
- ``optimal_no_swap``: the exact planner with host swap priced out (on a CPU machine the
  "host" is the same RAM, so swap is nearly free there and hides what selective
  recompute alone achieves);
- ``checkpoint_all``: every layer wrapped in ``torch.utils.checkpoint`` (non-reentrant),
  the usual answer; its peak excludes the activations recomputed during backward, which
  the checkpoint's own hooks hide from the store (so it is flattered, not penalised);
- ``deepspeed_ckpt``: DeepSpeed's PipelineEngine with ``activation_checkpoint_interval=1``
  on the blocks (when installed); its peak is what autograd saves, measured from outside
  with :class:`~trainwright.bench.meter.SavedTensorMeter`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainwright.bench import peers
from trainwright.bench.ours import train_rank
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.config import Config, load_config
from trainwright.model.gpt import GPTConfig, gpt_layers

__all__ = ["MemoryBenchSpec", "Checkpointed", "checkpointed_gpt", "run", "main"]


@dataclass(kw_only=True)
class MemoryBenchSpec:
    """Small GPT (embed, 6 blocks, head = 8 layers), 4 stages of 2 layers, 1F1B."""

    n_blocks: int = 6
    d_model: int = 256
    n_heads: int = 4
    context: int = 128
    stages: int = 4
    micro_batches: int = 8
    micro_batch_size: int = 4
    lr: float = 0.01
    steps: int = 5
    warmup: int = 1
    seed: int = 0
    threads_per_rank: int = 1
    limit_fraction: float = 0.5
    split: list[int] = field(default_factory=list)

    def layer_split(self) -> list[int]:
        """Layers per stage, as even as possible."""
        n = self.n_blocks + 2
        return self.split or [n // self.stages + (s < n % self.stages)
                              for s in range(self.stages)]


class Checkpointed(nn.Module):
    """A layer whose forward runs under ``torch.utils.checkpoint`` (recomputed in backward)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False)


def checkpointed_gpt(cfg: Config) -> list[nn.Module]:
    """Model factory: the built-in GPT with every layer under ``torch.utils.checkpoint``."""
    m = cfg.model
    layers = gpt_layers(GPTConfig(vocab=256, context=m.context, d_model=m.d_model,
                                  n_heads=m.n_heads, n_blocks=m.n_blocks))
    return [Checkpointed(layer) for layer in layers]


def _config(spec: MemoryBenchSpec, run_dir: Path, extra: list[str]) -> Config:
    return load_config(None, [
        f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}",
        "data.name=stdlib", "data.max_bytes=1000000", f"train.steps={spec.steps}",
        f"train.batch_size={spec.micro_batches * spec.micro_batch_size}",
        f"train.micro_batches={spec.micro_batches}", "train.schedule=1f1b",
        "train.optimizer=sgd", f"train.lr={spec.lr}", f"train.seed={spec.seed}",
        f"parallel.pp={spec.stages}", f"parallel.partition={spec.layer_split()}",
        f"parallel.threads_per_rank={spec.threads_per_rank}", "run.report=false",
        "run.progress=false", "run.checkpoint_every=0", "run.trace_steps=0",
        f"run.profile_every={spec.steps}", f'run.dir="{run_dir.parent}"',
        f'run.name="{run_dir.name}"', *extra,
    ])


def ours_worker(rank: int, world_size: int, master_port: int, spec: MemoryBenchSpec,
                out_path: str, *, extra: tuple = ()) -> None:
    """One rank of trainwright on the memory workload (``extra``: config overrides)."""
    rec = train_rank(rank, world_size, master_port, spec.threads_per_rank,
                     lambda run_dir: _config(spec, run_dir, list(extra)), out_path)
    steps = rec.steps
    plans = [r for r in rec.rows if r["kind"] == "memory_plan"]
    Path(out_path).write_text(json.dumps({
        "rank": rank, "step_times_s": rec.step_times_s(),
        "losses": [r["loss"] for r in steps] if rank == world_size - 1 else None,
        "peak_bytes_per_stage": [max(r["stages"][s]["activation_peak_bytes"] for r in steps)
                                 for s in range(spec.stages)],
        "host_peak_bytes_per_stage": [max(r["stages"][s].get("host_peak_bytes", 0)
                                          for r in steps) for s in range(spec.stages)],
        "policies": {p["stage"]: [x["policy"] for x in p["layers"]] for p in plans},
    }))


def _median_step(results: list[dict], warmup: int) -> float:
    return statistics.median(peers.step_time_s(results, warmup))


def run(spec: MemoryBenchSpec, repeats: int = 2, deepspeed: bool | None = None) -> dict:
    """Measure every row, ``repeats`` rounds interleaved; see the module docstring."""
    import functools

    from rich.progress import Progress

    world = spec.stages
    ours = lambda *extra: functools.partial(ours_worker, extra=extra)  # noqa: E731
    keep = peers.spawn_peer(ours(), spec, world_size=world)
    unconstrained = keep[0]["peak_bytes_per_stage"]
    limit = int(spec.limit_fraction * unconstrained[0])
    systems = {
        "keep": ours(),
        "greedy": ours(f"memory.limit={limit}", "memory.planner=greedy"),
        "optimal": ours(f"memory.limit={limit}", "memory.planner=optimal"),
        # on a CPU the "host" is the same RAM and a copy is cheap, so the planners lean on
        # swap; with swap priced out the planner must choose what to recompute instead
        "optimal_no_swap": ours(f"memory.limit={limit}", "memory.planner=optimal",
                                "memory.host_bandwidth=1000.0"),
        "checkpoint_all": ours('model.factory="trainwright.bench.memory:checkpointed_gpt"'),
    }
    use_ds = peers.deepspeed_available() if deepspeed is None else deepspeed
    if use_ds:
        ds_spec = PipelineBenchSpec(
            n_blocks=spec.n_blocks, d_model=spec.d_model, n_heads=spec.n_heads,
            context=spec.context, micro_batches=spec.micro_batches,
            micro_batch_size=spec.micro_batch_size, split=spec.layer_split(), lr=spec.lr,
            steps=spec.steps, warmup=spec.warmup, seed=spec.seed,
            threads_per_rank=spec.threads_per_rank)
        systems["deepspeed_ckpt"] = functools.partial(peers.deepspeed_worker,
                                                      activation_checkpointing=True)
    runs: dict[str, list] = {name: [] for name in systems}
    runs["keep"].append(keep)
    with Progress(transient=True) as bar:
        task = bar.add_task("bench memory", total=repeats * len(systems) - 1)
        for r in range(repeats):
            for name, fn in systems.items():
                if name == "keep" and r == 0:
                    continue
                bar.update(task, description=f"bench memory: {name}")
                worker_spec = ds_spec if name == "deepspeed_ckpt" else spec
                runs[name].append(peers.spawn_peer(fn, worker_spec, world_size=world))
                bar.advance(task)
    rows = []
    for name, rs in runs.items():
        last = rs[-1]
        if name == "deepspeed_ckpt":
            peaks = [x["saved_peak_bytes"] for x in last]
        else:
            peaks = last[0]["peak_bytes_per_stage"]
        losses = next(x["losses"] for x in last if x.get("losses"))
        row = {"system": name, "step_s": round(statistics.median(
            _median_step(x, spec.warmup) for x in rs), 4),
            "step_s_per_repeat": [round(_median_step(x, spec.warmup), 4) for x in rs],
            "peak_bytes_per_stage": peaks, "losses": [round(v, 5) for v in losses]}
        if name != "deepspeed_ckpt":
            row["host_peak_bytes_per_stage"] = last[0]["host_peak_bytes_per_stage"]
        if name in ("greedy", "optimal", "optimal_no_swap"):
            row["policies"] = last[0]["policies"]
            row["fits"] = all(p <= limit for p in peaks)
        rows.append(row)
    by = {r["system"]: r for r in rows}
    return {
        "benchmark": "memory",
        "question": "with every stage limited to half of stage 0's unconstrained activation "
                    "peak, do the planned policies fit, and at what cost vs recomputing "
                    "every layer?",
        "spec": asdict(spec), "repeats": repeats,
        "unconstrained_peak_bytes": unconstrained, "limit_bytes": limit, "rows": rows,
        "all_planned_stages_fit": all(by[n]["fits"] for n in ("greedy", "optimal",
                                                                "optimal_no_swap")),
        "ratio_vs_checkpoint_all": round(by["optimal"]["step_s"] / by["checkpoint_all"]["step_s"],
                                         3),
        "greedy_ratio_vs_checkpoint_all": round(
            by["greedy"]["step_s"] / by["checkpoint_all"]["step_s"], 3),
        "no_swap_ratio_vs_checkpoint_all": round(
            by["optimal_no_swap"]["step_s"] / by["checkpoint_all"]["step_s"], 3),
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench memory [--repeats N] [--steps N]``; returns the result."""
    spec = MemoryBenchSpec()
    if args.steps:
        spec.steps = args.steps
    return run(spec, repeats=args.repeats)
