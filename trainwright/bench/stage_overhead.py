"""What per-layer segments cost: one stage alone against one plain autograd graph.

The workload's whole model runs in one process, one thread, on the same micro-batches:

* ``plain``: ``nn.Sequential`` forward, loss, ``backward()`` per micro-batch (one graph:
  what torch pipelining's ``PipelineStage`` runs);
* ``ours_fast``: our :class:`~trainwright.pipeline.stage.Stage` on a fast step (what most
  steps of a run without a memory limit or rebalancing are: consecutive ``keep`` layers
  fused into one segment, nothing measured);
* ``ours_measured``: the same stage on a measured step (first and profile steps, or every
  step under a memory limit: one segment per layer, saved bytes counted by pack hooks).

Within a round the systems take turns step by step, in alternating (ABBA) order, so a
drift of the machine's speed hits them alike; the headline is the median of the
per-round paired ratios ``ours_fast / plain`` of their median step times. Sixteen rounds
by default: with each system's steps in one block per round, a round's ratio drifted by
about +-2.5 % on a 2-core machine, eight rounds' median still moved by about 1 % between
runs, and the target is 0.5 %.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from trainwright.bench.paired import paired, round_order, seconds
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.model.build import split_microbatches
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.stage import LayerSlot, Stage, StepMode
from trainwright.pipeline.store import ActivationStore

__all__ = ["measure", "isolated_compute_bound"]

SYSTEMS = ("plain", "ours_fast", "ours_measured")


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _steppers(spec: PipelineBenchSpec) -> tuple[dict, list]:
    layers = spec.layers()
    m = spec.micro_batches
    plain = nn.Sequential(*layers)
    stage = Stage([LayerSlot(i, f"l{i}", mod) for i, mod in enumerate(layers)],
                  ActivationStore(), LayerProfiler(), is_first=True, loss_fn=_loss,
                  loss_scale=1.0 / m)

    def run_plain(xs, ys):
        for x, y in zip(xs, ys, strict=True):
            (_loss(plain(x), y) / m).backward()

    def run_stage(xs, ys, fast: bool):
        stage.options.mode = StepMode(fast=fast)
        for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
            stage.forward(mb, (x,), y)
            stage.backward(mb)
        stage.profiler.end_step()

    steppers = {"plain": run_plain,
                "ours_fast": lambda xs, ys: run_stage(xs, ys, True),
                "ours_measured": lambda xs, ys: run_stage(xs, ys, False)}
    return steppers, list(plain.parameters())


def measure(spec: PipelineBenchSpec, rounds: int = 16, steps: int = 6, warmup: int = 1) -> dict:
    """Time ``steps`` steps of each system per round, taking turns step by step (ABBA),
    ``rounds`` rounds, after ``warmup`` untimed steps of each per round.

    Returns:
        ``rows`` (per system: per-round median step seconds), ``ratio`` (median of the
        paired ``ours_fast / plain`` ratios), ``paired_ratios``, ``ratio_spread``, and
        ``measured_ratio`` (the same for measured steps).
    """
    torch.set_num_threads(spec.threads_per_rank)
    steppers, params = _steppers(spec)
    data = spec.data()
    per_round: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    step_no = 0

    def one_step(name: str) -> float:
        nonlocal step_no
        step_no += 1
        x, y = data.batch(step_no, spec.batch_size)
        xs, ys = split_microbatches(x, spec.micro_batches), \
            split_microbatches(y, spec.micro_batches)
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        steppers[name](xs, ys)
        return time.perf_counter() - t0

    for r in range(rounds):
        for name in round_order(SYSTEMS, r):
            for _ in range(warmup):
                one_step(name)
        times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        for i in range(steps):  # the systems take turns step by step: drift hits them alike
            for name in round_order(SYSTEMS, r + i):
                times[name].append(one_step(name))
        for name in SYSTEMS:
            per_round[name].append(statistics.median(times[name]))
    fast = paired(per_round["ours_fast"], per_round["plain"])
    measured = paired(per_round["ours_measured"], per_round["plain"])
    return {"question": "one stage's forward + backward per step: our per-layer segments "
                        "(fast step) over one plain autograd graph, same work, one thread",
            "rounds": rounds, "steps_per_round": steps,
            "rows": {k: [seconds(v) for v in vals] for k, vals in per_round.items()},
            **fast,
            "measured_ratio": measured["ratio"],
            "measured_paired_ratios": measured["paired_ratios"],
            "measured_ratio_spread": measured["ratio_spread"]}


def isolated_compute_bound(spec: PipelineBenchSpec, micro_batches: int, steps: int = 5) -> dict:
    """The pipeline's compute bound measured outside it: each rank's layers (``spec.split``)
    in one process, plain autograd, over ``micro_batches`` micro-batches of the same
    batches (a stage's input comes from the layers before it, run without gradients);
    the slowest rank's median step is the bound a pipeline of these ranks cannot beat.

    Returns:
        ``bound_s`` (the slowest rank's median step seconds) and ``per_rank_s``.
    """
    spec = replace(spec, micro_batches=micro_batches)  # the batch the pipeline ran at m
    torch.set_num_threads(spec.threads_per_rank)
    layers = spec.layers()
    starts = [sum(spec.split[:r]) for r in range(len(spec.split))]
    ranks = [nn.Sequential(*layers[a:a + k]) for a, k in zip(starts, spec.split, strict=True)]
    data = spec.data()
    per_rank: list[list[float]] = [[] for _ in ranks]
    for step in range(1, steps + 2):  # the first step warms up, untimed
        x, y = data.batch(step, spec.batch_size)
        xs, ys = split_microbatches(x, micro_batches), split_microbatches(y, micro_batches)
        inputs = list(xs)
        for r, part in enumerate(ranks):
            last = r == len(ranks) - 1
            outputs = []
            t0 = time.perf_counter()
            for inp, tgt in zip(inputs, ys, strict=True):
                inp = inp if r == 0 else inp.detach().requires_grad_()
                out = part(inp)
                if last:
                    (_loss(out, tgt) / micro_batches).backward()
                else:
                    out.backward(torch.ones_like(out) / out.numel())
                    outputs.append(out.detach())
            seconds_ = time.perf_counter() - t0
            if step > 1:
                per_rank[r].append(seconds_)
            for p in part.parameters():
                p.grad = None
            inputs = outputs
    meds = [statistics.median(v) for v in per_rank]
    return {"bound_s": seconds(max(meds)), "per_rank_s": [seconds(v) for v in meds],
            "steps": steps}
