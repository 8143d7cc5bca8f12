"""Every benchmark target, and its verdict read from the committed JSON of the last run.

A target names a bench JSON (``docs/bench/NAME.json``), the key of its headline and,
where the bench ran paired rounds, the key of the per-round values. :func:`judge` gives
the median, the 90 % interval (:func:`~trainwright.bench.paired.interval`) and the
verdict on the interval's far end; a figure without rounds (a prediction error over a
sweep, a yes/no) is judged on its value, and the row says so. Where the bench judged a
figure itself (a ``KEY_judged`` block beside it), that block's median and interval are
used. :func:`summary_table` is
README.md's benchmark table, generated (``python tools/bench_summary.py``); a test keeps
the README equal to it, so no quoted headline can drift from its JSON.

Key paths are ``/``-separated (JSON keys such as ``"0.01"`` hold dots).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from trainwright.bench.paired import interval, verdict

__all__ = ["Target", "TARGETS", "lookup", "judge", "summary_rows", "summary_table"]


@dataclass(frozen=True)
class Target:
    """One target of one bench."""

    bench: str
    """The JSON file's stem under docs/bench (``"memory"``, ``"sparse"``)."""
    label: str
    """What is compared, for the table."""
    key: str
    """Key path of the headline figure."""
    bound: float | bool
    """The target: a number the headline must stay at or under (``at_most``) or at or
    over; or ``True`` for a yes/no figure that must hold."""
    rounds: str | None = None
    """Key path of the per-round values the headline is the median of, if any."""
    at_most: bool = True

    def describe(self) -> str:
        if isinstance(self.bound, bool):
            return "yes"
        return f"{'<=' if self.at_most else '>='} {self.bound:g}"


def _ratio(bench: str, label: str, key: str, bound: float, rounds: str | None = None,
           at_most: bool = True) -> Target:
    return Target(bench, label, key, bound, rounds, at_most)


TARGETS: list[Target] = [
    _ratio("straggler", "time to accuracy vs DDP, no straggler", "ratio_none_vs_ddp", 1.02,
           "ratio_none_vs_ddp_paired/paired_ratios"),
    _ratio("straggler", "vs DDP on the fast nodes, one permanent 3x straggler",
           "ratio_permanent_vs_ddp_fast_only", 1.05,
           "ratio_permanent_vs_ddp_fast_only_paired/paired_ratios"),
    _ratio("straggler", "vs DDP, transient stragglers", "ratio_transient_vs_ddp", 0.55,
           "ratio_transient_vs_ddp_paired/paired_ratios"),
    _ratio("straggler", "busiest node's bytes per step / gradient bytes",
           "busiest_node_bytes_per_step_over_grad", 2.5),
    *(_ratio("straggler", f"8 nodes: {label}", f"nodes_8/{key}", bound)
      for label, key, bound in (("no straggler vs DDP", "ratio_none_vs_ddp", 1.02),
                                ("permanent straggler vs DDP on the fast nodes",
                                 "ratio_permanent_vs_ddp_fast_only", 1.05),
                                ("transient stragglers vs DDP", "ratio_transient_vs_ddp", 0.55),
                                ("busiest node's bytes / gradient bytes",
                                 "busiest_node_bytes_per_step_over_grad", 2.5))),
    _ratio("planner", "step time prediction error, median over the sweep",
           "predict_step_error_median", 0.08),
    _ratio("planner", "step time prediction error, max", "predict_step_error_max", 0.15),
    _ratio("planner", "peak prediction error per stage, median", "predict_peak_error_median",
           0.03),
    _ratio("planner", "peak prediction error per stage, max", "predict_peak_error_max", 0.08),
    _ratio("planner", "stages over the limit their plan was made for", "plans_over_limit", 0),
    _ratio("planner", "planned stages in the sweep", "planned_stages", 40, at_most=False),
    _ratio("planner", "best predicted / best measured (samples/s)",
           "best_predicted_vs_best_measured", 1.05),
    Target("memory", "every planned stage within its limit, by the meter",
           "all_planned_rows_fit", True),
    _ratio("memory", "plan without swap / fastest fitting checkpoint rule",
           "ratio_vs_best_fitting_checkpoint", 0.9, "paired_ratios"),
    _ratio("hierarchical", "step time vs DDP, 2 x 2 ranks at 1 Gbit/s", "ratio_vs_ddp", 0.6,
           "paired_ratios"),
    *(_ratio("sparse", f"auto / best forced path at {d}", f"auto_vs_best_forced/{d}/ratio",
             1.05, f"auto_vs_best_forced/{d}/paired_ratios")
      for d in ("0.001", "0.01", "0.1", "0.5")),
    *(_ratio("sparse", f"auto / a plain dense all-reduce of the table at {d}",
             f"ratio_vs_dense_allreduce/{d}/ratio", 0.2 if d == "0.01" else 1.05,
             f"ratio_vs_dense_allreduce/{d}/paired_ratios")
      for d in ("0.001", "0.01", "0.1", "0.5")),
    _ratio("sparse", "vs DDP's sparse all-reduce at 1 %, loopback",
           "ratio_vs_ddp_sparse_at_1pct", 0.65, "paired_ratios"),
    _ratio("sparse", "vs DDP's sparse all-reduce at 1 %, 1 Gbit/s",
           "ratio_vs_ddp_sparse_at_1pct_shaped", 0.7, "shaped/paired_ratios"),
    _ratio("rebalance", "N steps from the unbalanced start, migration included, vs the "
           "best static partition from step 0", "end_to_end_vs_best_static", 0.9,
           at_most=False),
    _ratio("rebalance", "throughput after migrating / best static partition",
           "ratio_to_best", 0.9, "paired_ratios", at_most=False),
    *(_ratio("pipeline", f"our best schedule vs torch's best, m = {m}",
             f"ratio_vs_best_torch/{m}", 1.0, f"paired_ratios/{m}", at_most=False)
      for m in ("8", "4")),
    *(_ratio("pipeline", f"step / compute measured outside the pipeline, m = {m}",
             f"step_vs_isolated_compute_bound/{m}", 1.05) for m in ("8", "4")),
    *(_ratio("pipeline", f"ZB-H1's bubble / 1F1B's, m = {m}",
             f"by_micro_batches/{m}/zb_bubble_vs_1f1b_per_schedule/trainwright_zb-h1", 0.5)
      for m in ("8", "4")),
    _ratio("pipeline", "one stage's per-layer segments / one plain graph",
           "stage_overhead/measured_ratio", 1.005, "stage_overhead/measured_paired_ratios"),
    _ratio("plan_pick", "the plan's pick / the best of its next two candidates (samples/s)",
           "pick_vs_best_other", 0.95, "pick_vs_best_other_paired", at_most=False),
    Target("plan_pick", "planning an 8 B Llama and GPT-2 config.json under 30 s each",
           "planning_within_30_s", True),
    _ratio("checkpoint", "a step that saves asynchronously / a quiet step (no save in flight)",
           "async_save_step_over_quiet_step", 1.10),
    _ratio("checkpoint", "a step beside an async save's write / a quiet step",
           "async_beside_step_over_quiet_step", 1.10),
    Target("gpu", "every stage within its limit, by the CUDA allocator",
           "bench_memory_cuda/every_stage_within_limit", True),
    _ratio("gpu", "plan without swap / fastest fitting checkpoint rule (H100)",
           "bench_memory_cuda/ratio_vs_best_fitting_checkpoint", 0.9),
]
"""Every target the issues set, in the README table's order."""


def lookup(result: dict, path: str):
    """The value at ``path`` (``/``-separated keys) in ``result``; None where it is absent."""
    node = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def judge(target: Target, result: dict | None) -> dict:
    """Median, interval and verdict of ``target`` in a bench ``result`` (None: never run).

    ``verdict`` is ``"met"``, ``"missed"`` or ``"not measured"`` (the JSON lacks the key:
    the bench has not run since the key was added).
    """
    value = lookup(result, target.key) if result is not None else None
    if value is None:
        return {"median": None, "interval": None, "verdict": "not measured"}
    if isinstance(target.bound, bool):
        return {"median": bool(value), "interval": None,
                "verdict": "met" if bool(value) == target.bound else "missed"}
    block = lookup(result, target.key + "_judged")  # the bench judged it itself
    rounds = lookup(result, target.rounds) if target.rounds else None
    if isinstance(block, dict) and block.get("why"):  # the bench overruled the interval
        return {"median": block["median"], "interval": block.get("interval"),
                "verdict": block["verdict"]}
    if isinstance(block, dict) and block.get("interval"):
        med, bounds = block["median"], tuple(block["interval"])
    elif isinstance(rounds, list) and rounds:
        med, bounds = statistics.median(rounds), interval(rounds)
    else:
        return {"median": round(float(value), 4), "interval": None,
                "verdict": verdict((value, value), float(target.bound), at_most=target.at_most)}
    return {"median": round(float(med), 4), "interval": [float(b) for b in bounds],
            "verdict": verdict(bounds, float(target.bound), at_most=target.at_most)}


def summary_rows(bench_dir: Path) -> list[dict]:
    """Every target judged from the JSONs in ``bench_dir``."""
    cache: dict[str, dict | None] = {}
    out = []
    for t in TARGETS:
        if t.bench not in cache:
            path = bench_dir / f"{t.bench}.json"
            cache[t.bench] = json.loads(path.read_text()) if path.exists() else None
        out.append({"target": t, **judge(t, cache[t.bench])})
    return out


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.4g}"


def summary_table(bench_dir: Path) -> str:
    """README.md's benchmark table (markdown), one row per target."""
    lines = ["| bench | target | median | 90 % interval | bound | verdict |",
             "|---|---|---|---|---|---|"]
    for row in summary_rows(bench_dir):
        t = row["target"]
        iv = row["interval"]
        shown = f"{_fmt(iv[0])}-{_fmt(iv[1])}" if iv else "(no rounds)"
        v = row["verdict"]
        lines.append(f"| {t.bench} | {t.label} | {_fmt(row['median'])} | {shown} | "
                     f"{t.describe()} | {'**' + v + '**' if v == 'missed' else v} |")
    return "\n".join(lines) + "\n"
