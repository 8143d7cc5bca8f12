"""One self-contained HTML report of a training run, built from the files it left behind.

:func:`write_report` reads ``RUN_DIR/metrics.jsonl`` (``run``, ``step``, ``layers`` and
``end`` records) and ``RUN_DIR/trace.json`` (a Chrome/Perfetto trace) and writes
``RUN_DIR/report.html``: a summary table, then the loss curve, a timeline of one pipeline
step, per-stage memory and idle time, and per-layer time and memory, with every plot
embedded as a base64 PNG. Anything missing or unreadable (a crashed run, a truncated last
line, no trace) becomes a note on the page, never an exception.
"""

from __future__ import annotations

import html
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwright.observe import report_plots as plots
from trainwright.schedule.base import ActionKind

__all__ = ["RunMetrics", "load_metrics", "write_report"]

log = logging.getLogger(__name__)

_KINDS = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B,
          ActionKind.SYNC, ActionKind.STEP, ActionKind.F, ActionKind.B, ActionKind.W)
"""The kinds a report shows (an older trace's kind is the first that prefixes its event's
name)."""


@dataclass
class RunMetrics:
    """The records of one ``metrics.jsonl``.

    Attributes:
        runs: every ``run`` record, in file order (more than one after a resume).
        steps: ``step`` records sorted by step; a step logged twice (resume) keeps the last.
        layers: the last ``layers`` record, or ``None``.
        end: the ``end`` record, or ``None`` when the run did not finish cleanly.
        notes: problems met while reading, worded for the report.
    """

    runs: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    layers: dict | None = None
    end: dict | None = None
    memory_plans: dict[int, dict] = field(default_factory=dict)
    """The latest ``memory_plan`` record of each stage."""
    repartitions: list[dict] = field(default_factory=list)
    """``repartition`` records (live layer migrations), in step order."""
    decisions: list[dict] = field(default_factory=list)
    """``imbalance`` records (re-partition plans made on the last stage)."""
    evals: list[dict] = field(default_factory=list)
    """``eval`` records (held-out loss), sorted by step; a step logged twice keeps the last."""
    notes: list[str] = field(default_factory=list)


def load_metrics(path: str | Path) -> RunMetrics:
    """Parse a ``metrics.jsonl``, skipping unknown kinds and lines that are not JSON.

    Args:
        path: the file; a missing file gives empty metrics with a note.

    Returns:
        The parsed records.
    """
    path = Path(path)
    out = RunMetrics()
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        out.notes.append(f"No metrics: cannot read {path.name} ({exc.strerror or exc}).")
        return out
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    by_step: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for k, (lineno, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            last = k == len(numbered) - 1
            what = "last line is truncated" if last else f"line {lineno} is not valid JSON"
            out.notes.append(f"{path.name}: {what}; skipped it.")
            continue
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "run":
            out.runs.append(rec)
        elif kind == "step" and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
        elif kind == "layers" and isinstance(rec.get("layers"), list):
            out.layers = rec
        elif kind == "end":
            out.end = rec
        elif kind == "memory_plan" and isinstance(rec.get("stage"), int):
            out.memory_plans[rec["stage"]] = rec
        elif kind == "repartition":
            out.repartitions.append(rec)
        elif kind == "imbalance":
            out.decisions.append(rec)
        elif kind == "eval" and isinstance(rec.get("step"), int):
            evals[rec["step"]] = rec
    out.steps = [by_step[s] for s in sorted(by_step)]
    out.evals = [evals[s] for s in sorted(evals)]
    if not numbered:
        out.notes.append(f"{path.name} is empty: the run stopped before its first record.")
    return out


def _load_trace(path: Path) -> tuple[list[dict], dict[int, str], list[str]]:
    """Complete events that carry a step and a known kind, rank labels, and notes."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return [], {}, [f"No {path.name}: the run was not traced, so there is no timeline."]
    except (OSError, json.JSONDecodeError) as exc:
        return [], {}, [f"Cannot read {path.name} ({exc}); no timeline."]
    raw = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    events: list[dict] = []
    names: dict[int, str] = {}
    for e in raw if isinstance(raw, list) else []:
        if not isinstance(e, dict) or not isinstance(e.get("pid"), int):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in args:
            names[e["pid"]] = str(args["name"])
        elif e.get("ph") == "X" and isinstance(args.get("step"), int):
            ts, dur = plots.num(e.get("ts")), plots.num(e.get("dur"))
            kind = next((k for k in _KINDS if k == args.get("kind")), None)
            if kind is None:  # older traces: infer the kind from the event name
                kind = next((k for k in _KINDS if str(e.get("name", "")).startswith(k)), None)
            if ts is not None and dur is not None and kind is not None:
                events.append({**e, "ts": ts, "dur": dur, "args": {**args, "kind": kind}})
    return events, names, ([] if events else [f"{path.name} holds no step events."])


def _pick_step(events: list[dict]) -> tuple[int | None, str | None]:
    """The last step every rank finished (has its STEP event when the trace records any)."""
    if not events:
        return None, None
    ranks = {e["pid"] for e in events}
    has_step_kind = any(e["args"]["kind"] == ActionKind.STEP for e in events)
    seen: dict[int, set[int]] = {}
    for e in events:
        if not has_step_kind or e["args"]["kind"] == ActionKind.STEP:
            seen.setdefault(e["args"]["step"], set()).add(e["pid"])
    complete = [s for s, pids in seen.items() if pids == ranks]
    if complete:
        return max(complete), None
    last = max(e["args"]["step"] for e in events)
    return last, f"No step finished on every rank; showing the partial step {last}."


def _fmt(value: Any) -> str:
    v = plots.num(value)
    return "n/a" if v is None else f"{v:.6g}"


def _summary(run_dir: Path, m: RunMetrics) -> list[tuple[str, str]]:
    run = m.runs[-1] if m.runs else {}
    rows = [("run dir", str(run_dir))]
    for key in ("started", "world_size", "pp", "dp", "schedule", "mapping"):
        if key in run:
            rows.append((key, str(run[key])))
    part = run.get("partition")
    if isinstance(part, list):
        names = run.get("layer_names") if isinstance(run.get("layer_names"), list) else []
        desc = []
        for i, layers in enumerate(part):
            ids = layers if isinstance(layers, list) else [layers]
            named = [str(names[j]) for j in ids if isinstance(j, int) and 0 <= j < len(names)]
            counts = {n: named.count(n) for n in dict.fromkeys(named)}
            kinds = ", ".join(f"{n}×{c}" if c > 1 else n for n, c in counts.items())
            desc.append(f"stage {i}: {ids}" + (f" ({kinds})" if kinds else ""))
        rows.append(("partition", "; ".join(desc)))
    if len(m.runs) > 1:
        rows.append(("resumes", str(len(m.runs) - 1)))
    losses = [s.get("loss") for s in m.steps if plots.num(s.get("loss")) is not None]
    tput = [v for v in (plots.num(s.get("samples_per_s")) for s in m.steps) if v is not None]
    bub = [v for v in (plots.num(s.get("bubble_fraction")) for s in m.steps) if v is not None]
    rows += [
        ("steps logged", str(len(m.steps))),
        ("first loss", _fmt(losses[0]) if losses else "n/a"),
        ("last loss", _fmt(losses[-1]) if losses else "n/a"),
        *_eval_rows(m.evals),
        ("median samples/s", f"{statistics.median(tput):.1f}" if tput else "n/a"),
        *_throughput_rows(run, m.steps),
        ("mean bubble fraction", f"{statistics.fmean(bub):.1%}" if bub else "n/a"),
    ]
    if m.end is not None:
        rows.append(
            (
                "finished",
                f"{m.end.get('steps', '?')} steps, final loss "
                f"{_fmt(m.end.get('final_loss'))}, {_fmt(m.end.get('wall_s'))} s wall",
            )
        )
    else:
        rows.append(("finished", "no end record: the run crashed or is still going"))
    return rows


def _throughput_rows(run: dict, steps: list[dict]) -> list[tuple[str, str]]:
    """Summary rows of tokens/s and MFU (rows that carry them), what MFU is against, and
    each stage's peak resident memory (the process's, not the activation store's count)."""
    rows = []
    tokens = [v for v in (plots.num(s.get("tokens_per_s")) for s in steps) if v is not None]
    if tokens:
        rows.append(("median tokens/s", f"{statistics.median(tokens):,.0f}"))
    mfu = [v for v in (plots.num(s.get("mfu")) for s in steps) if v is not None]
    if mfu:
        peak = plots.num(run.get("peak_flops_per_s"))
        flops = plots.num(run.get("model_flops_per_step"))
        against = (f" of {peak / 1e12:.3g} TFLOP/s peak ({run.get('peak_source', '?')}); "
                   f"{flops / 1e9:.4g} GFLOP per step" if peak and flops else "")
        rows.append(("median MFU", f"{statistics.median(mfu):.1%}{against}"))
    resident: dict[int, float] = {}
    for s in steps:
        for st in s.get("stages") or []:
            v = plots.num(st.get("process_peak_bytes"))
            if v is not None and isinstance(st.get("stage"), int):
                resident[st["stage"]] = max(v, resident.get(st["stage"], 0.0))
    if resident:
        rows.append(("peak resident memory", "; ".join(
            f"stage {k}: {v / 2**20:,.0f} MiB" for k, v in sorted(resident.items()))))
    return rows


def _eval_rows(evals: list[dict]) -> list[tuple[str, str]]:
    """Summary rows of the held-out evaluation: its last loss (and perplexity)."""
    if not evals:
        return []
    last = evals[-1]
    text = f"{_fmt(last.get('loss'))} after step {last.get('step')}"
    if plots.num(last.get("perplexity")) is not None:
        text += f" (perplexity {_fmt(last['perplexity'])})"
    return [("last eval loss", text), ("evaluations", str(len(evals)))]


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse}td{padding:3px 12px;border-bottom:1px solid #ddd;
vertical-align:top}td:first-child{font-weight:600;white-space:nowrap}
img{max-width:100%;border:1px solid #eee}.caption{color:#555;margin:.3em 0 .8em}
.note{background:#fff6d6;border-left:4px solid #e0b000;padding:6px 10px;margin:.5em 0}
pre{background:#f6f6f6;padding:8px;overflow-x:auto}"""


def _section(title: str, caption: str, render: Callable[[], str | None], missing: str) -> str:
    try:
        png = render()
    except Exception as exc:  # a malformed record must cost one plot, not the whole report
        log.warning("report section %r failed", title, exc_info=True)
        png, missing = None, f"Could not draw this plot: {type(exc).__name__}: {exc}"
    body = (
        f'<p class="caption">{html.escape(caption)}</p>\n'
        f'<img src="data:image/png;base64,{png}" alt="{html.escape(title)}">'
        if png
        else f'<p class="note">{html.escape(missing)}</p>'
    )
    return f"<section>\n<h2>{html.escape(title)}</h2>\n{body}\n</section>\n"


def _memory_plan_section(m: RunMetrics) -> str:
    if not m.memory_plans:
        return ""
    rows = [{**r, "stage": s} for s, p in sorted(m.memory_plans.items()) for r in p["layers"]]
    head = "".join(
        f"<tr><td>stage {s}</td><td>{html.escape(str(p.get('planner')))}</td>"
        f"<td>{html.escape(str(p.get('reason')))}</td><td>{_fmt(p.get('required_bytes'))}"
        f"</td><td>{_fmt(p.get('limit_bytes'))}</td><td>{_fmt(p.get('step'))}</td></tr>\n"
        for s, p in sorted(m.memory_plans.items()))
    table = "".join(
        f"<tr><td>{r['stage']}</td><td>{r['layer']}</td><td>{html.escape(r['policy'])}</td>"
        f"<td>{_fmt(r.get('saved_bytes'))}</td><td>{_fmt(r.get('input_bytes'))}</td>"
        f"<td>{1e3 * (r.get('forward_s') or 0):.2f}</td>"
        f"<td>{1e3 * (r.get('swap_s') or 0):.2f}</td></tr>\n" for r in rows)
    plot = _section(
        "Memory plan",
        "Latest plan of each stage: bytes per micro-batch and layer; grey is the input every "
        "policy holds, the coloured part is what the policy keeps, swaps to host or "
        "recomputes.", lambda: plots.memory_plan_plot(rows), "No plan rows.")
    return (plot + "<section>\n<table>\n<tr><th>stage</th><th>planner</th><th>reason</th>"
            "<th>required bytes</th><th>limit bytes</th><th>after step</th></tr>\n" + head +
            "</table>\n<table>\n<tr><th>stage</th><th>layer</th><th>policy</th>"
            "<th>saved bytes</th><th>input bytes</th><th>forward ms (recompute cost)</th>"
            "<th>swap ms</th></tr>\n" + table + "</table>\n</section>\n")


def _repartition_section(m: RunMetrics) -> str:
    if not m.repartitions and not m.decisions:
        return ""
    plans = "".join(
        f"<tr><td>{_fmt(d.get('step'))}</td><td>{html.escape(str(d.get('old')))}</td>"
        f"<td>{html.escape(str(d.get('new')))}</td><td>{html.escape(str(d.get('rule')))}</td>"
        f"<td>{100 * (d.get('imbalance_before') or 0):.0f} %</td>"
        f"<td>{100 * (d.get('imbalance_predicted') or 0):.0f} %</td></tr>\n"
        for d in m.decisions)
    moves = "".join(
        f"<tr><td>{_fmt(r.get('step'))}</td><td>{html.escape(str(r.get('old')))}</td>"
        f"<td>{html.escape(str(r.get('new')))}</td><td>"
        + html.escape("; ".join(f"layers {mv['layers']} {mv['from']}&rarr;{mv['to']}"
                                for mv in r.get("moves", []))).replace("&amp;rarr;", "&rarr;")
        + f"</td><td>{_fmt(r.get('bytes_moved'))}</td><td>{1e3 * (r.get('time_s') or 0):.0f}"
        f"</td><td>{_fmt(r.get('in_flight'))}</td><td>{1e3 * (r.get('step_time_s') or 0):.0f}"
        f"</td></tr>\n" for r in m.repartitions)
    return ("<section>\n<h2>Re-partitions</h2>\n<p class=\"caption\">Plans made on the last "
            "stage when the stages' times drifted apart (imbalance = (max - min) / max of the "
            "per-layer times summed by stage), and the live migrations that applied them: "
            "layers moved, bytes sent by the giving stages, time from the first to the last "
            "migration action, micro-batches in flight on the giver.</p>\n"
            "<table>\n<tr><th>after step</th><th>partition</th><th>plan</th><th>rule</th>"
            "<th>imbalance</th><th>predicted</th></tr>\n" + plans + "</table>\n"
            "<table>\n<tr><th>step</th><th>from</th><th>to</th><th>moves</th><th>bytes</th>"
            "<th>ms</th><th>in flight</th><th>step ms</th></tr>\n" + moves
            + "</table>\n</section>\n")


def _build_html(run_dir: Path) -> str:
    m = load_metrics(run_dir / "metrics.jsonl")
    events, names, trace_notes = _load_trace(run_dir / "trace.json")
    step, note = _pick_step(events)
    notes = m.notes + trace_notes + ([note] if note else [])
    shown = [e for e in events if e["args"]["step"] == step]
    layers = [r for r in (m.layers or {}).get("layers", []) if isinstance(r, dict)]
    layer_step = (m.layers or {}).get("step", "?")
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>\n"
        for k, v in _summary(run_dir, m)
    )
    parts = [
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'>\n"
        f"<title>trainwright report: {html.escape(run_dir.name)}</title>\n"
        f"<style>{_CSS}</style></head><body>\n<h1>Training run report</h1>\n"
        f"<section>\n<h2>Summary</h2>\n<table>\n{rows}</table>\n"
    ]
    parts += [f'<p class="note">{html.escape(n)}</p>\n' for n in notes]
    if m.runs and isinstance(m.runs[-1].get("config"), dict):
        cfg = json.dumps(m.runs[-1]["config"], indent=2, sort_keys=True, default=str)
        parts.append(
            f"<details><summary>Full config</summary><pre>{html.escape(cfg)}</pre></details>\n"
        )
    parts.append("</section>\n")
    no_steps = "No step records: the run stopped before its first step."
    parts += [
        _section(
            "Loss and throughput",
            "Solid line: training loss per step (left axis), squares: held-out eval loss; "
            "dashed: samples/s (right).",
            lambda: plots.loss_plot(m.steps, m.evals),
            no_steps,
        ),
        _section(
            "Pipeline timeline",
            f"Step {step}, one row per rank, time in ms from the step's start; thin grey "
            "strips are sends/receives, numbers are micro-batches, white gaps are idle "
            "(the bubble).",
            lambda: plots.timeline_plot(shown, names, step or 0),
            " ".join(trace_notes) or "No timeline.",
        ),
        _section(
            "Activation memory per stage",
            "Peak activation memory each stage held during each step, in MiB; "
            "with 1F1B, earlier stages hold more micro-batches in flight.",
            lambda: plots.stage_memory_plot(m.steps),
            "No per-stage memory in the steps.",
        ),
        _section(
            "Compute vs idle per stage",
            "Mean per step: blue is compute, grey is time spent waiting (bubble and "
            "communication); the label is the idle share.",
            lambda: plots.stage_time_plot(m.steps),
            "No per-stage timings in the steps.",
        ),
        _section(
            "Per-layer time",
            f"From the layer profile at step {layer_step}: forward (solid) and backward "
            "(hatched) ms per micro-batch, coloured by stage; dotted lines split stages.",
            lambda: plots.layer_time_plot(layers),
            "No layer profile was recorded.",
        ),
        _section(
            "Per-layer saved activations",
            f"From the layer profile at step {layer_step}: bytes each layer keeps for "
            "backward per micro-batch, coloured by stage.",
            lambda: plots.layer_bytes_plot(layers),
            "No layer profile was recorded.",
        ),
    ]
    parts.append(_repartition_section(m))
    parts.append(_memory_plan_section(m))
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html`` from the run's ``metrics.jsonl`` and ``trace.json``.

    The page is written to a temporary file in ``run_dir`` and moved into place, so a
    reader never sees half a report. Missing or damaged inputs become notes on the page.

    Args:
        run_dir: the directory the training run wrote its files to.

    Returns:
        The path of the written report.

    Raises:
        NotADirectoryError: ``run_dir`` does not exist or is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotADirectoryError(
            f"run_dir {str(run_dir)!r} is not a directory; pass the "
            "directory the training run wrote metrics.jsonl to"
        )
    page = _build_html(run_dir.resolve())
    target = run_dir / "report.html"
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".report.", suffix=".html.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(page)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("wrote %s (%d bytes)", target, len(page))
    return target
