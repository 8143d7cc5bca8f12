"""Side-by-side benchmarks behind ``trainwright bench NAME``.

Each benchmark is a module ``trainwright.bench.NAME`` with ``main(args) -> dict`` (the
JSON the CLI writes); :data:`BENCHMARKS` maps names to modules, imported only when run.
Ours train through :class:`~trainwright.run.trainer.Trainer`; the peers (torch
pipelining, DeepSpeed, DDP, FSDP) as their users would set them up (:mod:`.peers`).

* benchmarks: ``pipeline`` (+ ``pipeline_figures``, ``stage_overhead``), ``rebalance``,
  ``memory`` (+ ``memory_cuda``, its GPU variant), ``planner`` (+ ``planner_forecast``,
  the sweep it runs, ``forecast_profile``, the one profile it takes, ``forecast_model``,
  what the sweep predicts from that profile,
  ``planner_predict``, ``calibrate``: the machine's step-time terms, ``noise_floor``:
  what a perfect predictor scores against the sweep's noisy rounds), ``sparse`` (+
  ``sparse_rank``, what each of its ranks runs),
  ``hierarchical`` (+ ``netns``, a two-tier network on one host), ``straggler``,
  ``checkpoint`` (async checkpoint saves vs blocking ones), ``plan_pick`` (the plan's
  pick against its next candidates; planning a real model's time);
* the shared workload and how it is compared: ``spec`` (+ ``spec_overrides``), ``paired``
  (paired rounds, intervals, verdicts), ``targets`` (every target, judged from the JSONs),
  ``ours`` (our rank under the peers' harness);
* peers: ``peers``, ``deepspeed_peer``;
* memory measured from outside: ``meter``, ``live_meter``.

May import every package but :mod:`trainwright.cli`.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "pipeline": "trainwright.bench.pipeline",
    "memory": "trainwright.bench.memory",
    "rebalance": "trainwright.bench.rebalance",
    "hierarchical": "trainwright.bench.hierarchical",
    "sparse": "trainwright.bench.sparse",
    "planner": "trainwright.bench.planner",
    "straggler": "trainwright.bench.straggler",
    "checkpoint": "trainwright.bench.checkpoint",
    "plan_pick": "trainwright.bench.plan_pick",
}


def run_benchmark(name: str, args) -> dict:
    """Run benchmark ``name`` with the CLI's parsed ``args``; returns its JSON data."""
    return importlib.import_module(BENCHMARKS[name]).main(args)
