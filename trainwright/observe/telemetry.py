"""Run outputs: ``metrics.jsonl`` rows, the Chrome/Perfetto ``trace.json``, and log format.

Rank 0 gathers every rank's :class:`~trainwright.pipeline.runtime.StepStats` once per step
and writes one ``step`` row; the per-layer cost table is written as a ``layers`` row every
few steps; trace events are kept per rank and merged into ``trace.json`` at the end.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays unimported for the CLI's quick paths
    from trainwright.observe.flops import StepCost

__all__ = ["MetricsWriter", "RunRecorder", "step_record", "write_trace", "setup_logging",
           "atomic_write_text"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class MetricsWriter:
    """Appends JSON rows to ``metrics.jsonl``, flushed per row so a crash loses nothing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = self.path.open("a")

    def write(self, kind: str, **row) -> None:
        """Append one row ``{"kind": kind, **row}``."""
        self._f.write(json.dumps({"kind": kind, **row}) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def riding_costs(stats: list) -> list[dict] | None:
    """The first pipeline's per-layer costs, in stage order, from the tables its stages
    sent with their stats (``StepStats.layer_costs``); None when no stage sent one."""
    tables = sorted((s.stage, s.layer_costs) for s in stats
                    if s.layer_costs is not None and s.replica == 0)
    return [c for _, table in tables for c in table] if tables else None


def step_record(stats: list, samples: int) -> dict:
    """Merge every rank's stats of one step into a metrics row.

    Args:
        stats: one ``StepStats`` per rank.
        samples: global samples in the step.

    Returns:
        ``step``, ``loss`` (mean over replicas), ``step_time_s`` (slowest rank),
        ``samples_per_s``, ``bubble_fraction`` (mean idle share) and per-stage figures.
    """
    wall = max(s.wall_s for s in stats)
    losses = [s.loss for s in stats if s.loss is not None]
    stages = []
    for idx in sorted({s.stage for s in stats}):
        mine = [s for s in stats if s.stage == idx]
        stages.append({
            "stage": idx,
            "compute_s": statistics.fmean(s.compute_s for s in mine),
            "idle_s": statistics.fmean(s.idle_s for s in mine),
            "activation_peak_bytes": max(s.activation_peak_bytes for s in mine),
            "held_microbatches_peak": max(s.held_microbatches_peak for s in mine),
        })
        stages[-1]["host_peak_bytes"] = max(s.host_peak_bytes for s in mine)
        copied = [s for s in mine if s.swap_copied_bytes]
        if copied:  # host-swap copies on the CPU: their thread CPU time (mean over replicas)
            stages[-1]["swap_copy_cpu_s"] = statistics.fmean(s.swap_copy_cpu_s for s in copied)
            stages[-1]["swap_copied_bytes"] = round(
                statistics.fmean(s.swap_copied_bytes for s in copied))
        resident = [s.process_peak_bytes for s in mine if s.process_peak_bytes]
        if resident:
            stages[-1]["process_peak_bytes"] = max(resident)
        cuda = [s.cuda_max_allocated_bytes for s in mine if s.cuda_max_allocated_bytes]
        if cuda:
            stages[-1]["cuda_max_allocated_bytes"] = max(cuda)
            stages[-1]["cuda_activation_peak_bytes"] = max(
                s.cuda_activation_peak_bytes for s in mine if s.cuda_max_allocated_bytes)
    update = next((s.update for s in stats if s.update), {})
    return {
        "step": stats[0].step,
        "loss": statistics.fmean(losses) if losses else None,
        **update,
        "step_time_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "bubble_fraction": statistics.fmean(s.idle_s / s.wall_s for s in stats if s.wall_s > 0),
        "stages": stages,
    }


def repartition_record(step: int, moved: list[dict], row: dict) -> dict:
    """One ``repartition`` metrics row from the migration stats of every involved rank.

    ``bytes_moved`` sums what every giver sent (all replicas); ``time_s`` is the longest
    time a stage spent from the first to the last migration action.
    """
    first = moved[0]
    return {"step": step, "old": first["old"], "new": first["new"], "moves": first["moves"],
            "bytes_moved": sum(m["bytes_sent"] for m in moved),
            "time_s": max(m["seconds"] for m in moved),
            "in_flight": max(m["in_flight"] for m in moved),
            "shipped_microbatches": max(m["shipped_microbatches"] for m in moved),
            "step_time_s": row["step_time_s"]}


def write_trace(path: Path, events: dict[int, list], names: dict[int, str]) -> None:
    """Write a Chrome/Perfetto trace: one process track per rank.

    Args:
        path: output file.
        events: rank -> ``(step, kind, mb, start_ns, dur_ns)`` tuples.
        names: rank -> track label, e.g. ``"rank 0 (stage 0, replica 0)"``.
    """
    out = []
    for rank, label in sorted(names.items()):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                    "args": {"sort_index": rank}})
    for rank, evs in events.items():
        for step, kind, mb, start, dur in evs:
            out.append({
                "name": f"{kind}{mb}" if mb >= 0 else kind, "ph": "X", "pid": rank, "tid": 0,
                "ts": start / 1e3, "dur": dur / 1e3,
                "args": {"step": step, "kind": kind, "mb": mb},
            })
    atomic_write_text(Path(path), json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))


def setup_logging(prefix: str, level: int = logging.INFO) -> None:
    """Log to stderr as ``HH:MM:SS [rank r stage s] LEVEL message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RunRecorder:
    """Rank 0's outputs of one run: metrics rows, the progress bar, trace and report.

    Args:
        run_dir: the run directory.
        run_row: fields of the ``run`` row (config, mesh, partition, layer names, ...).
        stage_of: stage of each layer index (to label the per-layer rows).
        batch_size: global samples per step.
        steps: last step of the run; ``start``: first step of this (possibly resumed) run.
        progress: show a progress bar.
        cost: FLOPs per step, tokens per sample and the devices' peak
            (:class:`~trainwright.observe.flops.StepCost`): ``tokens_per_s`` and ``mfu``.
        loggers: ``observe.loggers`` (:mod:`~trainwright.observe.loggers`).
    """

    def __init__(self, run_dir: Path, run_row: dict, stage_of: list[int], batch_size: int,
                 steps: int, start: int, progress: bool, cost: StepCost | None = None,
                 loggers: list[str] = ()):
        self.run_dir, self.stage_of, self.batch_size = Path(run_dir), stage_of, batch_size
        self.steps, self.cost = steps, cost
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl")
        self.writer.write("run", **run_row, **(cost.run_fields() if cost else {}),
                          start_step=start, time_started=time.time(),
                          started=datetime.datetime.now().isoformat(timespec="seconds"))
        self.loggers = None
        if loggers:
            from trainwright.observe.loggers import ScalarLoggers
            self.loggers = ScalarLoggers(list(loggers), self.run_dir, run_row.get("config", {}))
        self.progress = None
        if progress:
            from trainwright.observe.progress import StepProgress
            self.progress = StepProgress(steps, start - 1)
        self.loss: float | None = None
        self.eval_loss: float | None = None
        self._t0 = time.perf_counter()
        self._deferred: Callable[[], None] | None = None

    def write(self, kind: str, **row) -> None:
        """One more row of ``kind`` (e.g. ``model_edit``) in ``metrics.jsonl``."""
        self.settle()
        self.writer.write(kind, **row)

    def step(self, step: int, stats: list, layer_costs: list[dict] | None,
             stage_of: list[int] | None = None, at: float | None = None) -> None:
        """Record one step from every rank's stats (and the pipeline's layer costs, labelled
        by ``stage_of``, the stage of each layer now: a migration may have changed it);
        ``at``: when the step ended (default: now)."""
        self.settle()
        if stage_of is not None:
            self.stage_of = stage_of
        row = step_record(stats, self.batch_size)
        if self.cost is not None:
            row.update(self.cost.step_fields(row["samples_per_s"], row["step_time_s"]))
        row["time"] = time.time() if at is None else at
        self.loss = row["loss"]
        self.writer.write("step", **row)
        if self.loggers is not None:
            self.loggers.log("step", row)
        for st in stats:
            if st.memory_plan is not None and st.replica == 0:
                self.writer.write("memory_plan", step=step, stage=st.stage, **st.memory_plan)
        for st in stats:
            if st.decision is not None and st.replica == 0:
                self.writer.write("imbalance", **st.decision)
        moved = [st.migration for st in stats if st.migration is not None]
        if moved:
            self.writer.write("repartition", **repartition_record(step, moved, row))
        if layer_costs is None:
            layer_costs = riding_costs(stats)
        if layer_costs is not None:
            rows = [{**c, "stage": self.stage_of[c["layer"]]} for c in layer_costs
                    if c["layer"] < len(self.stage_of)]
            self.writer.write("layers", step=step, layers=rows)
        if self.progress is not None:
            self.progress.update(step, self.loss, row["samples_per_s"], row.get("tokens_per_s"),
                                 row.get("mfu"))

    def step_later(self, step: int, own, others: Callable[[], list],
                   layer_costs: list[dict] | None, stage_of: list[int]) -> None:
        """Record a step whose other ranks' stats are still on their way: its row is written
        from ``[own, *others()]`` just before the next row of any kind (so rows stay in
        order, and ``others`` is called when they have long arrived), or by :meth:`settle`."""
        self.settle()
        at = time.time()
        self._deferred = lambda: self.step(step, [own, *others()], layer_costs, stage_of, at)

    def settle(self) -> None:
        """Write the step row :meth:`step_later` left pending, if any."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred()

    def eval(self, row: dict) -> None:
        """Record an evaluation (``step``, ``loss``, ``perplexity``...): an ``eval`` row, and
        the progress bar shows it."""
        self.settle()
        self.eval_loss = row["loss"]
        self.writer.write("eval", **row)
        if self.loggers is not None:
            self.loggers.log("eval", row)
        if self.progress is not None:
            self.progress.show_eval(row["loss"], row.get("perplexity"))

    def finish(self, events: dict[int, list], names: dict[int, str], report: bool) -> None:
        """Write trace.json, the ``end`` row and the report; close the progress bar with the
        final loss and where the report (or the run directory) is."""
        self.settle()
        write_trace(self.run_dir / "trace.json", events, names)
        self.writer.write("end", steps=self.steps, final_loss=self.loss,
                          final_eval_loss=self.eval_loss,
                          wall_s=time.perf_counter() - self._t0)
        self.writer.close()
        if self.loggers is not None:
            self.loggers.close()
        page = None
        if report:
            from trainwright.observe.report import write_report
            page = write_report(self.run_dir)
        if self.progress is not None:  # its last line: the final loss and where to look
            self.progress.close(self.loss, self.eval_loss, page or self.run_dir)
