"""Matplotlib figures for :mod:`trainwright.observe.report`, each rendered to a base64 PNG string.

Figures are built with :class:`matplotlib.figure.Figure` directly and saved through the Agg
canvas, so nothing here touches pyplot's global state or the caller's chosen backend, and it
works on machines with no display. Every function takes already-parsed records (plain dicts)
and returns ``None`` when there is nothing to draw.
"""

from __future__ import annotations

import base64
import io
import math
from collections import defaultdict
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from trainwright.schedule.base import COMM, COMPUTE, ActionKind

__all__ = [
    "KIND_COLORS",
    "num",
    "loss_plot",
    "timeline_plot",
    "stage_memory_plot",
    "stage_time_plot",
    "layer_time_plot",
    "layer_bytes_plot",
]

KIND_COLORS: dict[ActionKind | str, str] = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#DD8452",
    ActionKind.W: "#55A868",
    "comm": "#9A9A9A",
    ActionKind.SYNC: "#8172B3",
    ActionKind.STEP: "#C44E52",
}
"""Box colour per trace event category (all SEND_*/RECV_* kinds share ``"comm"``)."""
_MIB = 1024.0 * 1024.0
_WIDTH_IN, _DPI = 10.0, 100


def num(value: Any) -> float | None:
    """Return ``value`` as a finite float, or ``None`` when it is missing or not a number.

    Args:
        value: anything read from a JSON record.

    Returns:
        The float, or ``None`` for ``None``, booleans, strings, NaN and infinities.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _stage_color(stage: int) -> str:
    return f"C{stage % 10}"


def _byte_unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((1024.0**3, "GiB"), (_MIB, "MiB"), (1024.0, "KiB")):
        if max_bytes >= scale:
            return scale, unit
    return 1.0, "bytes"


def loss_plot(steps: list[dict], evals: list[dict] | None = None) -> str | None:
    """Loss against step, with samples/s on a second y axis.

    Args:
        steps: ``"step"`` records sorted by step.
        evals: ``"eval"`` records (held-out loss), drawn as a second loss line.

    Returns:
        A base64 PNG, or ``None`` when no step has a loss.
    """
    pts = [(s["step"], num(s.get("loss"))) for s in steps]
    pts = [(x, y) for x, y in pts if y is not None]
    if not pts:
        return None
    fig = Figure(figsize=(_WIDTH_IN, 4.0), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    marker = "o" if len(pts) <= 40 else None
    lines = ax.plot(*zip(*pts, strict=True), color="C0", marker=marker, ms=3, label="loss")
    held = [(e["step"], num(e.get("loss"))) for e in evals or []]
    held = [(x, y) for x, y in held if y is not None]
    if held:
        lines += ax.plot(*zip(*held, strict=True), color="C2", marker="s", ms=4,
                         label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="C0")
    ax.grid(alpha=0.3)
    tput = [(s["step"], num(s.get("samples_per_s"))) for s in steps]
    tput = [(x, y) for x, y in tput if y is not None]
    if tput:
        ax2 = ax.twinx()
        lines += ax2.plot(
            *zip(*tput, strict=True), color="C1", ls="--", alpha=0.8, label="samples/s"
        )
        ax2.set_ylabel("samples/s", color="C1")
        ax2.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(
        lines,
        [ln.get_label() for ln in lines],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        frameon=False,
        fontsize=8,
    )
    return _png(fig)


def _category(kind: ActionKind) -> ActionKind | str:
    return "comm" if kind in COMM else kind


def timeline_plot(events: list[dict], rank_names: dict[int, str], step: int) -> str | None:
    """Gantt chart of one step: a row per rank, a box per trace event, coloured by kind.

    Compute, sync and optimizer boxes fill the row; send/recv boxes are a thin strip under
    it, since communication may overlap compute. F/B boxes wide enough carry the
    micro-batch number.

    Args:
        events: complete (``"ph": "X"``) events of ``step``, each with ``"kind"`` set in args.
        rank_names: row label per pid, from the trace's ``process_name`` metadata.
        step: the step shown, for the caption of the x axis.

    Returns:
        A base64 PNG, or ``None`` when ``events`` is empty.
    """
    if not events:
        return None
    t0 = min(e["ts"] for e in events)
    span_ms = max(e["ts"] + e["dur"] - t0 for e in events) / 1000.0 or 1.0
    ranks = sorted({e["pid"] for e in events})
    row = {pid: i for i, pid in enumerate(ranks)}
    height = max(2.4, 1.0 + 0.55 * len(ranks))
    fig = Figure(figsize=(_WIDTH_IN, height), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    px_per_ms = _WIDTH_IN * _DPI * 0.8 / span_ms
    boxes: dict[ActionKind | str, list[tuple[float, float, float]]] = defaultdict(list)
    for e in events:
        cat = _category(e["args"]["kind"])
        start, dur = (e["ts"] - t0) / 1000.0, e["dur"] / 1000.0
        y = row[e["pid"]]
        boxes[cat].append((start, dur, y))
        mb = e["args"].get("mb")
        wide = dur * px_per_ms >= 7 * len(str(mb)) + 4
        if cat in COMPUTE and isinstance(mb, int) and wide:
            ax.text(
                start + dur / 2,
                y - 0.08,
                str(mb),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    for cat, items in boxes.items():
        lefts, widths, ys = zip(*items, strict=True)
        if cat == "comm":
            ys, h = [y + 0.32 for y in ys], 0.16
        else:
            ys, h = [y - 0.08 for y in ys], 0.56
        ax.barh(
            ys,
            widths,
            left=lefts,
            height=h,
            color=KIND_COLORS.get(cat, "black"),
            edgecolor="white",
            linewidth=0.4,
        )
    ax.set_yticks(range(len(ranks)), [rank_names.get(p, f"rank {p}") for p in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel(f"ms since the start of step {step}")
    ax.grid(axis="x", alpha=0.3)
    labels = {
        ActionKind.F: "forward",
        ActionKind.B: "backward",
        ActionKind.W: "weight grads",
        "comm": "send/recv",
        ActionKind.SYNC: "DP grad sync",
        ActionKind.STEP: "optimizer",
    }
    handles = [Patch(color=KIND_COLORS[k], label=v) for k, v in labels.items()
               if k != ActionKind.W or ActionKind.W in boxes]
    ax.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=5,
        frameon=False,
        fontsize=8,
    )
    return _png(fig)


def _per_stage(steps: list[dict]) -> dict[int, list[dict]]:
    """Stage records per stage, each tagged with its step (entries of one stage in one step,
    e.g. from data-parallel replicas, stay separate)."""
    out: dict[int, list[dict]] = defaultdict(list)
    for s in steps:
        stages = s.get("stages")
        for rec in stages if isinstance(stages, list) else []:
            if isinstance(rec, dict) and isinstance(rec.get("stage"), int):
                out[rec["stage"]].append({**rec, "_step": s["step"]})
    return dict(sorted(out.items()))


def stage_memory_plot(steps: list[dict]) -> str | None:
    """Peak activation memory per stage against step, in MiB (max over replicas).

    Args:
        steps: ``"step"`` records sorted by step.

    Returns:
        A base64 PNG, or ``None`` when no step reports ``activation_peak_bytes``.
    """
    series: dict[int, dict[int, float]] = {}
    for stage, recs in _per_stage(steps).items():
        for r in recs:
            v = num(r.get("activation_peak_bytes"))
            if v is not None:
                cur = series.setdefault(stage, {})
                cur[r["_step"]] = max(cur.get(r["_step"], 0.0), v / _MIB)
    if not series:
        return None
    fig = Figure(figsize=(_WIDTH_IN, 3.6), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    for stage, pts in series.items():
        xs = sorted(pts)
        ax.plot(
            xs,
            [pts[x] for x in xs],
            color=_stage_color(stage),
            marker="o" if len(xs) <= 40 else None,
            ms=3,
            label=f"stage {stage}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("activation peak (MiB)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def stage_time_plot(steps: list[dict]) -> str | None:
    """Stacked bars of mean compute and idle seconds per stage, labelled with idle share.

    Args:
        steps: ``"step"`` records sorted by step.

    Returns:
        A base64 PNG, or ``None`` when no stage reports ``compute_s``/``idle_s``.
    """
    stats: list[tuple[int, float, float]] = []
    for stage, recs in _per_stage(steps).items():
        comp = [v for v in (num(r.get("compute_s")) for r in recs) if v is not None]
        idle = [v for v in (num(r.get("idle_s")) for r in recs) if v is not None]
        if comp or idle:
            stats.append((stage, _mean(comp) * 1000.0, _mean(idle) * 1000.0))
    if not stats:
        return None
    fig = Figure(
        figsize=(min(_WIDTH_IN, 3.0 + 1.0 * len(stats)), 3.6), dpi=_DPI, layout="constrained"
    )
    ax = fig.add_subplot()
    xs = range(len(stats))
    comp_ms, idle_ms = [c for _, c, _ in stats], [i for _, _, i in stats]
    ax.bar(xs, comp_ms, color=KIND_COLORS[ActionKind.F], label="compute")
    ax.bar(xs, idle_ms, bottom=comp_ms, color="#CCCCCC", label="idle")
    for x, c, i in zip(xs, comp_ms, idle_ms, strict=True):
        if c + i > 0:
            ax.text(
                x, c + i, f"{100 * i / (c + i):.0f}% idle", ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(list(xs), [f"stage {s}" for s, _, _ in stats])
    ax.set_ylabel("mean ms per step")
    ax.margins(y=0.12)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False, fontsize=8)
    return _png(fig)


def _layer_axes(layers: list[dict], height: float) -> tuple[Figure, Any]:
    n = len(layers)
    fig = Figure(
        figsize=(min(16.0, max(_WIDTH_IN, 0.25 * n)), height), dpi=_DPI, layout="constrained"
    )
    ax = fig.add_subplot()
    every = max(1, math.ceil(n / 60))
    ticks = list(range(0, n, every))
    names = [f"{layers[i].get('layer', i)} {layers[i].get('name', '')}" for i in ticks]
    ax.set_xticks(
        ticks,
        names,
        rotation=90 if n > 10 else 45,
        ha="center" if n > 10 else "right",
        fontsize=7 if n > 24 else 8,
    )
    ax.set_xlim(-0.6, n - 0.4)
    ax.grid(axis="y", alpha=0.3)
    prev = None
    for i, rec in enumerate(layers):  # dashed line at each stage boundary
        if prev is not None and rec.get("stage") != prev:
            ax.axvline(i - 0.5, color="black", ls=":", lw=0.8)
        prev = rec.get("stage")
    return fig, ax


def _top_legend(ax: Any, handles: list[Patch]) -> None:
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=min(len(handles), 8),
        frameon=False,
        fontsize=8,
    )


def _stage_handles(layers: list[dict]) -> list[Patch]:
    stages = sorted({r["stage"] for r in layers if isinstance(r.get("stage"), int)})
    return [Patch(color=_stage_color(s), label=f"stage {s}") for s in stages]


def layer_time_plot(layers: list[dict]) -> str | None:
    """Per-layer forward (solid) and backward (hatched) time, stacked, coloured by stage.

    Args:
        layers: entries of the last ``"layers"`` record, in layer order.

    Returns:
        A base64 PNG, or ``None`` when no layer reports a time.
    """
    fwd = [(num(r.get("forward_s")) or 0.0) * 1000.0 for r in layers]
    bwd = [(num(r.get("backward_s")) or 0.0) * 1000.0 for r in layers]
    if not layers or not any(fwd) and not any(bwd):
        return None
    fig, ax = _layer_axes(layers, 4.2)
    colors = [
        _stage_color(r["stage"]) if isinstance(r.get("stage"), int) else "grey" for r in layers
    ]
    xs = range(len(layers))
    ax.bar(xs, fwd, color=colors, edgecolor="white", linewidth=0.3)
    ax.bar(
        xs, bwd, bottom=fwd, color=colors, alpha=0.55, hatch="///", edgecolor="white", linewidth=0.3
    )
    ax.set_ylabel("ms per micro-batch")
    handles = _stage_handles(layers) + [
        Patch(facecolor="grey", label="forward"),
        Patch(facecolor="grey", alpha=0.55, hatch="///", edgecolor="white", label="backward"),
    ]
    _top_legend(ax, handles)
    return _png(fig)


def layer_bytes_plot(layers: list[dict]) -> str | None:
    """Activation bytes each layer saves for backward, coloured by stage.

    Args:
        layers: entries of the last ``"layers"`` record, in layer order.

    Returns:
        A base64 PNG, or ``None`` when no layer reports ``saved_bytes``.
    """
    saved = [num(r.get("saved_bytes")) or 0.0 for r in layers]
    if not any(saved):
        return None
    scale, unit = _byte_unit(max(saved))
    fig, ax = _layer_axes(layers, 4.0)
    colors = [
        _stage_color(r["stage"]) if isinstance(r.get("stage"), int) else "grey" for r in layers
    ]
    ax.bar(range(len(layers)), [v / scale for v in saved], color=colors)
    ax.set_ylabel(f"saved for backward ({unit})")
    _top_legend(ax, _stage_handles(layers))
    return _png(fig)


_POLICY_COLORS = {"keep": "#4C72B0", "swap": "#DD8452", "recompute": "#C44E52"}


def memory_plan_plot(rows: list[dict]) -> str | None:
    """Per-layer activation bytes of the latest memory plans, coloured by policy.

    Args:
        rows: plan rows (``layer, policy, saved_bytes, input_bytes, stage``) of every stage.

    Returns:
        A base64 PNG, or ``None`` without rows.
    """
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: r.get("layer", 0))
    saved = [num(r.get("saved_bytes")) or 0.0 for r in rows]
    kept = [num(r.get("input_bytes")) or 0.0 for r in rows]
    scale, unit = _byte_unit(max(max(saved), max(kept), 1.0))
    fig, ax = _layer_axes(rows, 4.0)
    xs = range(len(rows))
    ax.bar(xs, [v / scale for v in kept], color="#999999")
    ax.bar(xs, [v / scale for v in saved], bottom=[v / scale for v in kept],
           color=[_POLICY_COLORS.get(r.get("policy"), "grey") for r in rows])
    ax.set_ylabel(f"per micro-batch ({unit})")
    handles = [Patch(color="#999999", label="input (always held)")] + [
        Patch(color=c, label=f"activations: {p}") for p, c in _POLICY_COLORS.items()]
    _top_legend(ax, handles)
    return _png(fig)
