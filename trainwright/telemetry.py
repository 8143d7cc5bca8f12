"""Run outputs: ``metrics.jsonl`` rows, the Chrome/Perfetto ``trace.json``, and log format.

Rank 0 gathers every rank's :class:`~trainwright.pipeline.runtime.StepStats` once per step
and writes one ``step`` row; the per-layer cost table is written as a ``layers`` row every
few steps; trace events are kept per rank and merged into ``trace.json`` at the end.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
from pathlib import Path

__all__ = ["MetricsWriter", "step_record", "write_trace", "setup_logging", "atomic_write_text"]


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
        cuda = [s.cuda_max_allocated_bytes for s in mine if s.cuda_max_allocated_bytes]
        if cuda:
            stages[-1]["cuda_max_allocated_bytes"] = max(cuda)
    return {
        "step": stats[0].step,
        "loss": statistics.fmean(losses) if losses else None,
        "step_time_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "bubble_fraction": statistics.fmean(s.idle_s / s.wall_s for s in stats if s.wall_s > 0),
        "stages": stages,
    }


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
