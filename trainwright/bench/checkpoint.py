"""``trainwright bench checkpoint``: does a step that saves a checkpoint wait for the disk?

The question: with ``run.async_checkpoint = true``, how much longer is a step that saves
than one that does not? Target: at most 10 % longer (the ratio's 90 % interval at or under
1.10, :func:`~trainwright.bench.paired.judged`).

One process trains an MLP (``d_model`` wide, ``n_blocks`` blocks, SGD with momentum, so a
checkpoint holds the weights and one moment) through
:class:`~trainwright.run.trainer.Trainer`, saving every ``every`` steps, once with
``async_checkpoint`` (``async``) and once with blocking saves (``blocking``, the baseline;
the model is sized so that a blocking save takes longer than a step). Per run: the median
time of the steps that save and of the steps that do not (the first step, unfused, left
out); per round, each system's ratio of the two. Rounds alternate the systems' order
(:func:`~trainwright.bench.paired.round_order`).

``--steps``, ``--repeats`` and ``--spec KEY=VALUE`` (``d_model``, ``n_blocks``,
``batch_size``, ``every``) size it; ``--repeats 1 --steps 6 --spec d_model=64`` is a smoke run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from trainwright.errors import ConfigError

__all__ = ["CheckpointSpec", "run", "main", "SYSTEMS"]

SYSTEMS = ("async", "blocking")
TARGET = 1.10


@dataclass(frozen=True)
class CheckpointSpec:
    """The workload: an MLP of ``n_blocks`` blocks ``d_model`` wide, saved every ``every``
    steps over ``steps`` steps."""

    d_model: int = 2048
    n_blocks: int = 8
    batch_size: int = 64
    every: int = 3
    steps: int = 16
    rounds: int = 5


def _config(spec: CheckpointSpec, system: str, run_dir: Path):
    from trainwright.config import load_config

    return load_config(None, [
        'model.name="mlp"', "parallel.pp=1", f"model.d_model={spec.d_model}",
        f"model.n_blocks={spec.n_blocks}",
        f"train.batch_size={spec.batch_size}", f"train.steps={spec.steps}",
        'train.optimizer="sgd"', "train.momentum=0.9", "train.micro_batches=1",
        f"run.checkpoint_every={spec.every}",
        f"run.async_checkpoint={'true' if system == 'async' else 'false'}",
        "run.report=false", "run.progress=false", "run.trace_steps=0",
        f"run.profile_every={spec.steps + 1}", f'run.dir="{run_dir}"'])


def run(system: str, spec: CheckpointSpec) -> dict:
    """One run of ``system``: median seconds of the saving and the other steps."""
    import torch.distributed as dist

    from trainwright.run.trainer import Trainer

    if not dist.is_initialized():  # one rank, as a launched job would have it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="tw-bench-ckpt-") as tmp:
        trainer = Trainer(_config(spec, system, Path(tmp)), Path(tmp))
        times = {}
        for step in range(1, spec.steps + 1):
            t0 = time.perf_counter()
            trainer.train_step(step)
            times[step] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.finish()  # waits for the last save
        drain = time.perf_counter() - t0
        trainer.close()
    saving = [t for s, t in times.items() if s > 1 and s % spec.every == 0 and s < spec.steps]
    plain = [t for s, t in times.items() if s > 1 and s % spec.every != 0]
    if not saving or not plain:
        raise ConfigError(f"bench checkpoint: steps={spec.steps}, every={spec.every} leave no "
                          f"saving step or no plain step after the first; raise --steps")
    return {"save_step_s": statistics.median(saving), "plain_step_s": statistics.median(plain),
            "drain_s": drain}


def main(args) -> dict:
    """``trainwright bench checkpoint``: the two systems side by side, paired per round."""
    from trainwright.bench.paired import host_info, judged, round_order

    spec = CheckpointSpec()
    for item in getattr(args, "spec", None) or []:
        key, _, value = item.partition("=")
        if key not in {f.name for f in fields(CheckpointSpec)}:
            raise ConfigError(f"--spec {item}: unknown key; choose one of "
                              f"{[f.name for f in fields(CheckpointSpec)]}")
        spec = replace(spec, **{key: int(value)})
    if getattr(args, "steps", None):
        spec = replace(spec, steps=args.steps)
    if getattr(args, "repeats", None):
        spec = replace(spec, rounds=args.repeats)
    per_round: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(spec.rounds):
        for system in round_order(SYSTEMS, r):
            per_round[system].append(run(system, spec))
    ratios = {s: [x["save_step_s"] / x["plain_step_s"] for x in per_round[s]] for s in SYSTEMS}
    rows = [{"system": s,
             "step_s": round(statistics.median(x["plain_step_s"] for x in per_round[s]), 5),
             "save_step_s": round(statistics.median(x["save_step_s"] for x in per_round[s]), 5),
             "save_over_plain": judged(ratios[s], TARGET)} for s in SYSTEMS]
    # the step a save must not slow is a quiet one: the blocking run's plain step (nothing
    # written in the background); the async run's own plain steps share the cores with its
    # background writer, so a ratio to them would hide the writer's cost
    quiet = [x["plain_step_s"] for x in per_round["blocking"]]
    over_quiet = {k: [x[k] / q for x, q in zip(per_round["async"], quiet, strict=True)]
                  for k in ("save_step_s", "plain_step_s")}
    blocking_extra = statistics.median(
        x["save_step_s"] - x["plain_step_s"] for x in per_round["blocking"])
    plain = statistics.median(x["plain_step_s"] for x in per_round["blocking"])
    return {"benchmark": "checkpoint", "spec": asdict(spec), "host": host_info(),
            "rows": rows, "per_round": per_round,
            "async_save_step_over_plain": rows[0]["save_over_plain"]["median"],
            "async_save_step_over_plain_judged": rows[0]["save_over_plain"],
            "async_save_step_over_quiet_step": judged(over_quiet["save_step_s"], TARGET)["median"],
            "async_save_step_over_quiet_step_judged": judged(over_quiet["save_step_s"], TARGET),
            "async_plain_step_over_quiet_step_judged": judged(over_quiet["plain_step_s"], TARGET),
            "async_verdict": rows[0]["save_over_plain"]["verdict"],
            "blocking_save_longer_than_a_step": blocking_extra > plain}
