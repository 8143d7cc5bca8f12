"""``trainwright bench checkpoint``: does a step that saves a checkpoint wait for the disk?

The question: with ``run.async_checkpoint = true``, how much longer is a step that saves
than a quiet one (no save in flight)? Target: at most 10 % longer (the ratio's 90 %
interval at or under 1.10, :func:`~trainwright.bench.paired.judged`).

One process trains an MLP (``d_model`` wide, ``n_blocks`` blocks, SGD with momentum, so a
checkpoint holds the weights and one moment) through
:class:`~trainwright.run.trainer.Trainer`, saving every ``every`` steps, once with
``async_checkpoint`` (``async``) and once with blocking saves (``blocking``, the baseline;
the model is sized so that a blocking save takes longer than a step). Rounds alternate the
systems' order (:func:`~trainwright.bench.paired.round_order`). Per run, each step is
timed and marked by whether a save was in flight when it began or ended (the first step,
unfused, left out):

* ``save_step_s``: the median step that saves (``first_save_step_s``: the first, which
  also allocates the host buffers the copies go into from then on);
* ``quiet_step_s``: the median step that neither saves nor runs beside a save in flight
  (the reference a saving step is judged against, the same run minutes apart at most);
* ``beside_step_s``: the median step that runs beside an async save's write (none with
  blocking saves): whether the step after a save waits for the disk, judged against the
  same 1.10;
* ``mean_step_s``: the mean of every step, saves and all: where the cost of saving went.
  An async save's copy, write and checksum still take CPU time; on a host whose cores
  training keeps busy the steps that run beside it pay for it, and this mean shows it.

The headline ``async_save_step_over_quiet_step`` is the async run's saving step over its
own quiet step; ``async_save_step_over_blocking_quiet_step_judged`` divides it by the
blocking run's quiet step of the same round instead; ``*_mean_step_over_quiet_step`` and
``async_mean_step_over_blocking_mean_step`` say what saving costs over a whole run.

A save every 50 steps (``run.checkpoint_every``'s default), five a run: the write runs at
a low priority (:data:`~trainwright.run.ckpt_writer.WRITER_NICE`) and spreads over 15-30
steps here (at every 30, 4 of 15 saves waited); a save asked for while the one before is
still being written waits for it (counted per run as ``saves_that_waited``).

``--steps``, ``--repeats`` and ``--spec KEY=VALUE`` (``d_model``, ``n_blocks``,
``batch_size``, ``every``) size it; ``--repeats 1 --steps 6 --spec d_model=64 --spec
every=2`` is a smoke run.
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
    every: int = 50
    steps: int = 251
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
    """One run of ``system``: median seconds of the saving and the quiet steps, the mean
    step, and how long the end waited for the last save."""
    import torch.distributed as dist

    from trainwright.run.trainer import Trainer

    if not dist.is_initialized():  # one rank, as a launched job would have it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="tw-bench-ckpt-") as tmp:
        trainer = Trainer(_config(spec, system, Path(tmp)), Path(tmp))
        times, beside_a_save, waited = {}, set(), 0
        for step in range(1, spec.steps + 1):
            saves = step % spec.every == 0 and step < spec.steps
            before = trainer.checkpoints.writing
            waited += saves and before
            t0 = time.perf_counter()
            trainer.train_step(step)
            times[step] = time.perf_counter() - t0
            if before or (trainer.checkpoints.writing and not saves):
                beside_a_save.add(step)
        t0 = time.perf_counter()
        trainer.finish()  # waits for the last save
        drain = time.perf_counter() - t0
        trainer.close()
    timed = {s: t for s, t in times.items() if s > 1 and s < spec.steps}  # the last: a save
    saving = [t for s, t in timed.items() if s % spec.every == 0]
    quiet = [t for s, t in timed.items() if s % spec.every != 0 and s not in beside_a_save]
    beside = [t for s, t in timed.items() if s % spec.every != 0 and s in beside_a_save]
    if not saving or not quiet:
        raise ConfigError(f"bench checkpoint: steps={spec.steps}, every={spec.every} leave no "
                          f"saving step or no quiet step after the first; raise --steps")
    return {"save_step_s": statistics.median(saving), "quiet_step_s": statistics.median(quiet),
            "first_save_step_s": saving[0],
            "beside_step_s": statistics.median(beside) if beside else None,
            "beside_steps": len(beside),
            "mean_step_s": statistics.mean(timed.values()), "drain_s": drain,
            "quiet_steps": len(quiet), "saves_that_waited": waited}


def main(args) -> dict:
    """``trainwright bench checkpoint``: the two systems side by side, paired per round."""
    from trainwright.bench.paired import host_info, judged, paired, round_order

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

    def _figures(num: str, den: str, system: str, ref: str) -> tuple[list, list]:
        return [x[num] for x in per_round[system]], [x[den] for x in per_round[ref]]

    def ratios(num: str, den: str, system: str = "async", ref: str = "async") -> list[float]:
        return [a / b for a, b in zip(*_figures(num, den, system, ref), strict=True)]

    rows = [{"system": s,
             **{k: round(statistics.median(x[k] for x in per_round[s]), 5)
                for k in ("quiet_step_s", "save_step_s", "mean_step_s")},
             "save_over_quiet": judged(ratios("save_step_s", "quiet_step_s", s, s), TARGET),
             "mean_over_quiet": paired(*_figures("mean_step_s", "quiet_step_s", s, s)),
             "saves_that_waited": sum(x["saves_that_waited"] for x in per_round[s])}
            for s in SYSTEMS]
    beside_ratios = [x["beside_step_s"] / x["quiet_step_s"] for x in per_round["async"]
                     if x["beside_step_s"] is not None]  # a tiny save can end in its step
    beside = judged(beside_ratios, TARGET) if beside_ratios else None
    blocking_extra = statistics.median(
        x["save_step_s"] - x["quiet_step_s"] for x in per_round["blocking"])
    quiet = statistics.median(x["quiet_step_s"] for x in per_round["blocking"])
    headline = rows[0]["save_over_quiet"]
    return {"benchmark": "checkpoint", "spec": asdict(spec), "host": host_info(),
            "rows": rows, "per_round": per_round,
            "async_save_step_over_quiet_step": headline["median"],
            "async_save_step_over_quiet_step_judged": headline,
            "async_save_step_over_blocking_quiet_step_judged": judged(
                ratios("save_step_s", "quiet_step_s", ref="blocking"), TARGET),
            "async_beside_step_over_quiet_step": beside and beside["median"],
            "async_beside_step_over_quiet_step_judged": beside,
            "async_mean_step_over_quiet_step": rows[0]["mean_over_quiet"],
            "blocking_mean_step_over_quiet_step": rows[1]["mean_over_quiet"],
            "async_mean_step_over_blocking_mean_step": paired(
                *_figures("mean_step_s", "mean_step_s", "async", "blocking")),
            "async_verdict": headline["verdict"],
            "blocking_save_longer_than_a_step": blocking_extra > quiet}

