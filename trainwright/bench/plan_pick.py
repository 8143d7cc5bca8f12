"""``trainwright bench plan_pick``: is the plan's pick the fastest of its top candidates, and
how long does planning a real model take?

Two questions of the "plan your own model" issue, answered the way a user meets them,
through the command line:

* **the pick**: ``trainwright plan --model gpt ... --topology cpu --devices CORES --top 3
  --json PLAN`` on this host (one device per core), then ``trainwright run --plan PLAN
  --candidate K`` for K = 1, 2, 3, in ``repeats`` rounds, the candidates in alternating
  order. Per round, the pick's samples/s (median over the steps after ``warmup``) over
  the best of the other two; target: at least 0.95 (the pick is the fastest, or within 5
  % of it), judged on the far end of the 90 % interval
  (:func:`~trainwright.bench.paired.judged`);
* **planning time**: the wall time of ``trainwright plan --model CONFIG.json --topology
  nvswitch8 --gpu-memory 80GB --nodes 2 --global-batch 256`` (a fresh process, as a user
  runs it) for a Llama-style 8 B ``config.json`` and GPT-2's, each written here (no
  download); target: under 30 s each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainwright.bench.paired import host_info, judged, round_order, seconds

log = logging.getLogger(__name__)

__all__ = ["PlanPickSpec", "LLAMA_8B", "GPT2", "run", "main"]

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
"""A Llama-3-8B-shaped ``config.json`` (8,030,261,248 parameters)."""
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
        "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}
"""GPT-2's ``config.json`` (124,439,808 parameters)."""


@dataclass
class PlanPickSpec:
    """The tiny model planned and run on this host, and the rounds."""

    n_blocks: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    batch_size: int = 32
    steps: int = 16
    warmup: int = 4
    repeats: int = 4
    top: int = 3


def _cli(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwright", *args], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _model_sets(spec: PlanPickSpec) -> list[str]:
    kv = {"model.n_blocks": spec.n_blocks, "model.d_model": spec.d_model,
          "model.n_heads": spec.n_heads, "model.context": spec.context,
          "train.batch_size": spec.batch_size, "train.steps": spec.steps,
          "data.name": "stdlib", "train.optimizer": "sgd"}
    return [x for k, v in kv.items() for x in ("--set", f"{k}={v}")]


def _step_s(run_dir: Path, warmup: int) -> float:
    """Median step seconds after ``warmup`` steps of a run."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r["kind"] == "step"][warmup:]
    return statistics.median(times)


def _run_candidate(plan: Path, k: int, runs: Path, spec: PlanPickSpec) -> float:
    """Median step seconds of candidate ``k`` run with ``trainwright run --plan``."""
    name = f"cand{k}-{time.monotonic_ns()}"
    got = _cli("run", "--plan", str(plan), "--candidate", str(k),
               "--set", f'run.dir="{runs}"', "--set", f'run.name="{name}"',
               "--set", "run.report=false", "--set", "run.progress=false",
               "--set", f"train.steps={spec.steps}", "--set", "run.checkpoint_every=0")
    if got.returncode != 0:
        raise RuntimeError(f"candidate {k} failed: {got.stderr.strip()[-600:]}")
    return _step_s(runs / name, spec.warmup)


def pick_rounds(spec: PlanPickSpec, work: Path, say=log.info) -> dict:
    """Plan the tiny model for this host, then race the top candidates (module docstring)."""
    plan = work / "plan.json"
    got = _cli("plan", "--model", "gpt", *_model_sets(spec), "--topology", "cpu",
               "--devices", str(os.cpu_count() or 1), "--top", str(spec.top),
               "--json", str(plan))
    if got.returncode != 0:
        raise RuntimeError(f"trainwright plan failed: {got.stderr.strip()[-600:]}")
    doc = json.loads(plan.read_text())
    n = len(doc["top"])
    names = [f"candidate {k}" for k in range(1, n + 1)]
    per: dict[str, list[float]] = {x: [] for x in names}
    for r in range(spec.repeats):
        for x in round_order(names, r):
            say(f"round {r + 1}/{spec.repeats}: {x}")
            per[x].append(_run_candidate(plan, int(x.split()[1]), work / "runs", spec))
    # step seconds -> the pick's samples/s over the best other's, per round
    ratios = [min(per[x][r] for x in names[1:]) / per[names[0]][r]
              for r in range(spec.repeats)] if n > 1 else []
    return {"candidates": [{"rank": k + 1, "label": doc["top"][k]["label"],
                            "step_s_per_round": [seconds(t) for t in per[names[k]]]}
                           for k in range(n)],
            "pick_vs_best_other": round(statistics.median(ratios), 4) if ratios else None,
            "pick_vs_best_other_paired": [round(x, 4) for x in ratios],
            "pick_vs_best_other_judged": judged(ratios, 0.95, at_most=False) if ratios
            else None}


def planning_time(work: Path) -> dict:
    """Wall seconds of ``trainwright plan`` for the 8 B Llama and GPT-2 configs."""
    out = {}
    for name, hf in (("llama8b", LLAMA_8B), ("gpt2", GPT2)):
        folder = work / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf))
        t0 = time.perf_counter()
        got = _cli("plan", "--model", str(folder / "config.json"), "--topology", "nvswitch8",
                   "--gpu-memory", "80GB", "--nodes", "2", "--global-batch", "256",
                   "--json", str(work / f"{name}.json"))
        wall = time.perf_counter() - t0
        out[name] = {"wall_s": round(wall, 2), "ok": got.returncode == 0,
                     "within_30_s": got.returncode == 0 and wall < 30}
        if got.returncode != 0:
            out[name]["error"] = got.stderr.strip()[-600:]
    return out


def run(spec: PlanPickSpec, say=log.info) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tw-bench-plan-pick-") as tmp:
        work = Path(tmp)
        planning = planning_time(work)
        picks = pick_rounds(spec, work, say)
    return {"benchmark": "plan_pick", "spec": asdict(spec), "planning": planning,
            "planning_within_30_s": all(v["within_30_s"] for v in planning.values()),
            **picks, "wall_s": round(time.perf_counter() - t0, 1), "host": host_info()}


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench plan_pick [--repeats N] [--steps N]``."""
    spec = PlanPickSpec()
    if args.repeats:
        spec.repeats = args.repeats
    if args.steps:
        spec.steps = args.steps
    return run(spec, say=lambda s: log.info("bench plan_pick: %s", s))
