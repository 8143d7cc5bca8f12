"""What was alive at a rank's metered peak, by the action and the layer that made it.

The footprint walk (:mod:`trainwright.plan.footprint`) is checked against the live meter
(:mod:`trainwright.bench.live_meter`); when the two disagree, this says which tensors the
meter saw that the walk did not, or the other way round. Every mismatch found this way
(2026-11-27: sent outputs past ``W``, the step's data, receive buffers posted ahead, a
recomputed layer's first output) was a whole number of tensors.

Run the configuration with the meter's level-2 detail and a trace of the metered steps::

    TW_BENCH_METER_DIR=/tmp/meter TW_BENCH_METER_STEPS=2 TW_BENCH_METER_DETAIL=2 \\
        python -m trainwright run --set 'model.factory="trainwright.bench.live_meter:bench_gpt"' \\
        --set 'data.factory="trainwright.bench.live_meter:bench_data"' \\
        --set run.trace_steps=4 ... --set 'run.dir="/tmp/runs"' --set 'run.name="x"'
    python tools/meter_at_peak.py /tmp/meter/rank1.json /tmp/runs/x/trace.json 1

It prints the rank's peak, the action running then, and the live bytes per (action that
made them, op, metered layer).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def action_at(events: list[dict], rank: int, t_us: float) -> str:
    """``"F3@2"`` (action name at step): the traced action of ``rank`` running at ``t_us``
    (microseconds, the trace's clock); ``"between actions"`` if none was."""
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == rank and e["ts"] <= t_us <= e["ts"] + e["dur"]:
            return f"{e['name']}@{e.get('args', {}).get('step', '?')}"
    return "between actions"


def attribute(live: list[dict], events: list[dict], rank: int) -> Counter:
    """Live bytes at the peak per ``(action that made them, op, layer)``.

    Args:
        live: the meter's ``live_at_peak`` rows (``op``, ``layer``, ``bytes``, ``time`` in
            seconds of ``time.time()``).
        events: the run's ``trace.json`` ``traceEvents``.
        rank: the rank (the trace's ``pid``).
    """
    out: Counter = Counter()
    for row in live:
        out[(action_at(events, rank, row["time"] * 1e6), row["op"], row["layer"])] += row["bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("meter", type=Path, help="the rank's meter JSON (TW_BENCH_METER_DIR)")
    ap.add_argument("trace", type=Path, help="the run's trace.json (run.trace_steps > 0)")
    ap.add_argument("rank", type=int)
    args = ap.parse_args()
    got = json.loads(args.meter.read_text())
    if "live_at_peak" not in got:
        raise SystemExit(f"{args.meter} has no live_at_peak: run with TW_BENCH_METER_DETAIL=2")
    trace = json.loads(args.trace.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    live = got["live_at_peak"]
    peak_t = max((row["time"] for row in live), default=0.0) * 1e6
    print(f"rank {args.rank}: peak {got['peak_bytes']} bytes, last made during "
          f"{action_at(events, args.rank, peak_t)}")
    for (action, op, layer), n in sorted(attribute(live, events, args.rank).items()):
        print(f"  {action:<16} {op:<55} {layer:<14} {n:>10} B")


if __name__ == "__main__":
    main()
