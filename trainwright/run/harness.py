"""The trainer on a given GPT, without run-directory outputs: for tests and benchmarks of
memory policies.

:func:`run_gpt_pipeline` trains the built-in GPT through
:class:`~trainwright.run.trainer.Trainer` as one rank of an initialised default
process group (one stage per rank, ``dp = 1``), with per-layer policies (keep / swap /
recompute) and, optionally, peer swap from a plan in the JSON form ``trainwright
plan`` writes. It returns what the caller compares: the stage's parameters, the measured
per-step wall time and activation peak (the store's bytes, chunks held for peers included),
and the per-layer profile (:class:`~trainwright.observe.layer_profile.LayerProfiler`) the
simulator is calibrated with.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.run.trainer import Trainer, TrainerOptions

__all__ = ["GPTJob", "run_gpt_pipeline", "job_layers", "job_batch", "job_config"]


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


def job_config(job: GPTJob, policies: dict[int, str] | None = None) -> Config:
    """The configuration that trains ``job``: one stage per rank, SGD, every step traced."""
    n_layers = job.n_blocks + 2
    pol = [(policies or {}).get(i, "keep") for i in range(n_layers)] if policies else []
    return Config.from_dict({
        "model": {"n_blocks": job.n_blocks, "d_model": job.d_model, "n_heads": job.n_heads,
                  "context": job.context},
        "train": {"steps": job.steps, "batch_size": job.micro_batches * job.micro_batch_size,
                  "micro_batches": job.micro_batches, "schedule": job.schedule,
                  "optimizer": "sgd", "lr": job.lr, "seed": job.seed},
        "parallel": {"pp": len(job.parts), "dp": 1, "partition": list(job.parts)},
        "memory": {"policies": pol},
        "run": {"trace_steps": job.steps, "profile_every": job.steps, "progress": False,
                "report": False},
        "runtime": {"p2p_timeout_s": job.timeout_s}})


class _JobData:
    """The job's batches behind the trainer's data interface."""

    def __init__(self, job: GPTJob):
        self.job = job

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s tokens and targets."""
        return job_batch(self.job, step)


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
    world = dist.get_world_size()
    if len(job.parts) != world:
        raise ValueError(f"{len(job.parts)} stages need {len(job.parts)} ranks, got {world}")
    step_s, peaks, profiles, events = [], [], [], []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(job_config(job, policies), run_dir, options=TrainerOptions(
            layers=lambda: _named(job), data=_JobData(job), peer_plan=peer_plan,
            peer_group=peer_group, profiler=LayerProfiler(smoothing=1.0), outputs=False))

        def on_step(step: int, stats) -> None:
            events.append([(k, mb, dur / 1e9, start / 1e9) for s, k, mb, start, dur
                           in trainer.trace_events if s == step])
            step_s.append(stats.wall_s)
            peaks.append(stats.activation_peak_bytes)
            profiles.append([c.to_dict() for c in trainer.profiler.table()])
            coll.barrier()  # every step starts together, as the simulator assumes

        coll.barrier()
        trainer.fit(on_step)
    peer = trainer.store.peer
    return {"params": {f"{s.index}.{n}": p.detach().clone() for s in trainer.stage.slots
                       for n, p in s.module.named_parameters()},
            "step_s": step_s, "peak_bytes": peaks, "profiles": profiles, "events": events,
            "held_peak_bytes": peer.peak_held_bytes if peer else 0,
            "sent_bytes": peer.sent_bytes if peer else 0}


def _named(job: GPTJob) -> list:
    return [(f"layer{i}", m) for i, m in enumerate(job_layers(job))]
