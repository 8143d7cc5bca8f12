"""A pipeline job without the worker's files: for tests and benchmarks of memory policies.

:func:`run_gpt_pipeline` trains the built-in GPT as one rank of an initialised default
process group (one stage per rank, ``dp = 1``), with per-layer policies (keep / swap /
recompute) and, optionally, seed 004 peer swap from a plan in the JSON form ``trainwright
plan`` writes. It returns what the caller compares: the stage's parameters, the measured
per-step wall time and activation peak (the store's bytes, chunks held for peers included),
and the per-layer profile (:class:`~trainwright.profile.LayerProfiler`) the simulator is
calibrated with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.comm import P2P
from trainwright.models.gpt import GPTConfig, gpt_layers
from trainwright.pipeline.peer_setup import attach
from trainwright.pipeline.runtime import PipelineRuntime
from trainwright.pipeline.schedule import build_schedule
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import ActivationStore
from trainwright.profile import LayerProfiler
from trainwright.sync import GradSync

__all__ = ["GPTJob", "run_gpt_pipeline", "job_layers", "job_batch"]


@dataclass
class GPTJob:
    """The workload: model shape, split, schedule, batches."""

    n_blocks: int = 2
    d_model: int = 32
    n_heads: int = 2
    context: int = 16
    vocab: int = 64
    parts: list = field(default_factory=lambda: [1, 1, 1, 1])
    schedule: str = "1f1b"
    micro_batches: int = 4
    micro_batch_size: int = 2
    steps: int = 2
    lr: float = 0.05
    seed: int = 0
    timeout_s: float = 60.0


class _LocalStep(GradSync):
    """``dp = 1``: nothing to average; each layer's optimizer steps."""

    def sync(self, params: list) -> None:
        """No replicas."""


def job_layers(job: GPTJob) -> list:
    """The whole model, the same on every rank (seeded)."""
    torch.manual_seed(job.seed)
    return gpt_layers(GPTConfig(vocab=job.vocab, context=job.context, d_model=job.d_model,
                                n_heads=job.n_heads, n_blocks=job.n_blocks))


def job_batch(job: GPTJob, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens and targets (deterministic)."""
    g = torch.Generator().manual_seed(job.seed * 1000 + step)
    n = job.micro_batches * job.micro_batch_size
    x = torch.randint(0, job.vocab, (n, job.context + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def run_gpt_pipeline(job: GPTJob, policies: dict[int, str] | None = None,
                     peer_plan: dict | None = None, peer_group=None) -> dict:
    """Train ``job`` as this rank's stage (rank = stage) and report.

    Args:
        policies: layer -> ``keep | swap | recompute`` (missing: keep).
        peer_plan: ``{"tensors": [[per-tensor rows of stage s] for s], "peers": {owner
            stage: [peer stages]}}`` (the ``trainwright plan`` JSON keys), or None.
        peer_group: process group for peer transfers (default: a new one; collective).

    Returns:
        ``params`` (name -> tensor of this stage), ``step_s`` and ``peak_bytes`` per step,
        ``held_peak_bytes`` (chunks held for peers, at most), ``profiles`` (per-layer costs
        per step), ``events`` (per step: ``(kind, mb, seconds, start)`` of every action, start
        in seconds of ``time.time_ns``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = job.parts
    if len(parts) != world:
        raise ValueError(f"{len(parts)} stages need {len(parts)} ranks, got {world}")
    layers = job_layers(job)
    first = sum(parts[:rank])
    idx = list(range(first, first + parts[rank]))
    slots = [LayerSlot(i, f"layer{i}", layers[i], torch.optim.SGD(layers[i].parameters(),
                                                                   lr=job.lr)) for i in idx]
    store, prof = ActivationStore(), LayerProfiler(smoothing=1.0)
    store.set_policies({i: (policies or {}).get(i, "keep") for i in idx})
    last = rank == world - 1
    stage = Stage(slots, store, prof, is_first=rank == 0, loss_fn=_loss if last else None,
                  loss_scale=1.0 / job.micro_batches)
    sched = build_schedule(job.schedule, world, job.micro_batches)
    actions, extensions = sched[rank], None
    if peer_plan is not None:
        actions, extensions = attach(peer_plan, rank, rank, {k: k for k in range(world)}, store,
                                     sched, job.timeout_s, group=peer_group)
    peer = store.peer
    p2p = P2P(dist.group.WORLD, rank, job.timeout_s, torch.device("cpu"))
    runtime = PipelineRuntime(stage, actions, p2p, prev_rank=rank - 1 if rank else None,
                              next_rank=rank + 1 if not last else None, grad_sync=_LocalStep(),
                              extensions=extensions)
    step_s, peaks, profiles, events = [], [], [], []
    for step in range(1, job.steps + 1):
        x, y = job_batch(job, step)
        xs = list(x.chunk(job.micro_batches)) if rank == 0 else None
        ys = list(y.chunk(job.micro_batches)) if last else None
        dist.barrier()
        stats = runtime.run_step(step, xs, ys, trace=True)
        events.append([(k, mb, dur / 1e9, start / 1e9) for k, mb, start, dur in stats.events])
        step_s.append(stats.wall_s)
        peaks.append(stats.activation_peak_bytes)
        profiles.append([c.to_dict() for c in prof.table()])
    return {"params": {f"{i}.{n}": p.detach().clone() for i in idx
                       for n, p in layers[i].named_parameters()},
            "step_s": step_s, "peak_bytes": peaks, "profiles": profiles, "events": events,
            "held_peak_bytes": peer.peak_held_bytes if peer else 0,
            "sent_bytes": peer.sent_bytes if peer else 0}
