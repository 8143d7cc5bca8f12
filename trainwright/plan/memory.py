"""Per-layer activation storage policies for one pipeline stage: keep, swap or recompute.

A stage holds, for every micro-batch in flight, the tensors autograd saved for its layers'
backward. Each layer gets a policy: ``"keep"`` (they stay on the device), ``"swap"`` (copied to
host memory after forward and back before backward) or ``"recompute"`` (only the layer's input
is kept; its forward is re-run right before its backward).

Cost model (bytes and seconds per micro-batch; ``host_bandwidth`` in bytes/s):

* ``swap_cost(l) = l.saved_bytes / host_bandwidth`` and ``recompute_cost(l) = l.forward_s``;
* ``T = sum(l.forward_s + l.backward_s)``: swaps up to ``T`` hide behind the stage's compute;
* ``held(l) = l.saved_bytes + l.input_bytes`` when kept, else ``l.input_bytes``;
* ``transient = max(saved_bytes of non-keep layers, default 0)``: swapped or recomputed
  activations come back one layer at a time, during that layer's backward;
* ``required_bytes = in_flight * sum(held) + transient``;
* ``added_time = sum(forward_s of recompute layers) + max(0, sum(swap_cost of swap layers) - T)``.

A stage fits when ``required_bytes < limit_bytes`` (:func:`needs_optimising` fires at ``>=``).
Pure: no torch; numbers in, a :class:`MemoryPlan` out. Shared arguments: ``layers`` (the
stage's :class:`LayerMem` rows, in model order), ``policies`` (layer -> policy; missing layers
are kept), ``in_flight`` (micro-batches held at the peak, see :func:`in_flight`),
``limit_bytes`` (the activation budget; None for none), ``host_bandwidth`` (device-host copy
bandwidth, bytes/s), ``reason`` (why a plan was made; a summary if empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainwright.errors import PlanError

__all__ = [
    "POLICIES", "InFlight", "ChunkInFlight", "LayerMem", "MemoryPlan", "in_flight", "held_peak",
    "required_bytes", "added_time",
    "needs_optimising", "min_feasible_bytes", "greedy_plan", "optimal_plan", "plan_stage",
    "format_bytes",
]

POLICIES = ("keep", "swap", "recompute")
_MIB = float(1 << 20)
_TIME_UNITS = 1e6  # the MILP measures time in millionths of the largest possible added time
_TIE_BREAK = 1e-9  # the tie-break may cost at most this fraction of that largest added time


@dataclass(frozen=True)
class LayerMem:
    """Memory and time of one layer, per micro-batch (``saved_bytes`` excludes the input)."""

    layer: int
    saved_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    chunk: int = 0
    """The model chunk (virtual stage) holding the layer; matters only with a
    :class:`ChunkInFlight` (several chunks per rank)."""


@dataclass
class MemoryPlan:
    """A policy for every layer of a stage, with its memory peak and added time."""

    policies: dict[int, str]
    required_bytes: int
    added_time_s: float
    limit_bytes: int | None
    planner: str
    reason: str

    def to_rows(self, layers: list[LayerMem], host_bandwidth: float) -> list[dict]:
        """One row per layer, in the order of ``layers``, for metrics and the report.

        Args:
            layers, host_bandwidth: see the module.

        Returns:
            Dicts with ``layer, policy, saved_bytes, input_bytes, forward_s, swap_s``.
        """
        return [{"layer": x.layer, "policy": self.policies.get(x.layer, "keep"),
                 "saved_bytes": x.saved_bytes, "input_bytes": x.input_bytes,
                 "forward_s": x.forward_s, "swap_s": x.saved_bytes / host_bandwidth}
                for x in layers]

    @classmethod
    def build(cls, layers: list[LayerMem], policies: dict[int, str], in_flight: int,
              limit_bytes: int | None, host_bandwidth: float, planner: str = "fixed",
              reason: str = "") -> MemoryPlan:
        """Cost given policies (``planner="fixed"``: e.g. policies from the configuration).

        Args:
            layers, policies, in_flight, limit_bytes, host_bandwidth, reason: see the module.
            planner: ``"greedy"``, ``"optimal"`` or ``"fixed"``.

        Returns:
            The plan, with a policy for every layer.

        Raises:
            ValueError: malformed layers or an unknown policy.
        """
        _check(layers, in_flight, host_bandwidth)
        policies = {x.layer: _policy(policies, x.layer) for x in layers}
        need = required_bytes(layers, policies, in_flight)
        if not reason:
            limit = "no limit" if limit_bytes is None else f"limit {format_bytes(limit_bytes)}"
            reason = f"{planner} plan: required {format_bytes(need)}, {limit}"
        return cls(policies, need, added_time(layers, policies, host_bandwidth), limit_bytes,
                   planner, reason)


def in_flight(schedule: str, n_stages: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak.

    Args:
        schedule: ``"1f1b"`` or ``"gpipe"``.
        n_stages: pipeline stages.
        stage: this stage, ``0 <= stage < n_stages``.
        micro_batches: micro-batches per step, at least 1.

    Returns:
        ``min(n_stages - stage, micro_batches)`` for 1F1B, ``micro_batches`` for GPipe.

    Raises:
        ValueError: unknown schedule or out-of-range numbers.
    """
    if not 0 <= stage < n_stages or micro_batches < 1 or schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"need schedule '1f1b' or 'gpipe', 0 <= stage < n_stages and "
                         f"micro_batches >= 1; got {schedule!r}, stage={stage}, "
                         f"n_stages={n_stages}, micro_batches={micro_batches}")
    return min(n_stages - stage, micro_batches) if schedule == "1f1b" else micro_batches


def _check(layers: list[LayerMem], n_in_flight: int, host_bandwidth: float = 1.0) -> None:
    neg = [x.layer for x in layers if min(x.saved_bytes, x.input_bytes, x.forward_s) < 0
           or x.backward_s < 0]
    duplicates = len({x.layer for x in layers}) < len(layers)
    if n_in_flight < 0 or not host_bandwidth > 0 or neg or duplicates:
        raise ValueError(f"need in_flight >= 0, host_bandwidth > 0, unique layer indices and no "
                         f"negative bytes or times; got in_flight={n_in_flight}, "
                         f"host_bandwidth={host_bandwidth}, negatives in layers {neg}")


class InFlight(int):
    """An ``in_flight`` count that also carries ``w_wait``: under a zero-bubble schedule, the
    micro-batches at most between their ``B`` and their ``W``. The activations of their
    swapped and recomputed layers come back at ``B`` and stay on the device until ``W``, so
    :func:`required_bytes` adds ``w_wait * sum(saved_bytes of non-keep layers)``."""

    w_wait: int = 0
    actions: tuple = ()
    """The rank's schedule (its :class:`~trainwright.schedule.base.Action` list), for the
    footprint walk (:mod:`trainwright.plan.footprint`); empty when not known."""

    arrive: dict | None = None
    """When receive buffers come into being, under a runtime that posts receives ahead
    (:func:`trainwright.plan.footprint.arrivals`); None: each at its own receive."""

    def __new__(cls, n: int, w_wait: int = 0, actions: tuple = (),
                arrive: dict | None = None) -> InFlight:
        obj = int.__new__(cls, n)
        obj.w_wait = w_wait
        obj.actions = tuple(actions)
        obj.arrive = dict(arrive) if arrive is not None else None
        return obj


def _w_wait(in_flight: int) -> int:
    return getattr(in_flight, "w_wait", 0)


class ChunkInFlight(int):
    """In-flight counts of a rank that runs several model chunks (interleaved 1F1B, ZB-V).

    Each chunk's layers hold activations for that chunk's micro-batches only. ``states``
    lists every maximal moment of the step as ``{chunk: (held, waiting_w)}``
    (:func:`trainwright.schedule.occupancy.chunk_states`): ``held`` micro-batches of the
    chunk forwarded and not released, ``waiting_w`` of them between ``B`` and ``W`` (their
    swapped and recomputed tensors back on the device). The required bytes are the
    largest over the states of ``sum(held * held bytes + waiting_w * brought-back bytes)``
    over the layers, each weighted by its own chunk's counts (:attr:`LayerMem.chunk`).
    The int value is the most ``(chunk, micro-batch)`` pairs held at once."""

    states: tuple = ()
    actions: tuple = ()
    """The rank's schedule, as :attr:`InFlight.actions`."""

    arrive: dict | None = None
    """As :attr:`InFlight.arrive`."""

    def __new__(cls, states: list[dict[int, tuple[int, int]]],
                actions: tuple = (), arrive: dict | None = None) -> ChunkInFlight:
        if not states:
            raise ValueError("ChunkInFlight needs at least one state")
        obj = int.__new__(cls, max(sum(h for h, _ in st.values()) for st in states))
        obj.states = tuple(dict(st) for st in states)
        obj.actions = tuple(actions)
        obj.arrive = dict(arrive) if arrive is not None else None
        return obj

    def __repr__(self) -> str:
        return f"ChunkInFlight({list(self.states)})"


def held_peak(in_flight: int, per_chunk: dict[int, int],
              brought_back: dict[int, int] | None = None) -> int:
    """Most bytes held at once when chunk ``c`` holds ``per_chunk[c]`` bytes per micro-batch
    in flight, and ``brought_back[c]`` more per micro-batch waiting for its ``W``:
    ``in_flight * sum + w_wait * sum`` with one stage per rank (:class:`InFlight`), else
    the largest over the states of a :class:`ChunkInFlight` of the per-chunk sums."""
    back = brought_back or {}
    states = getattr(in_flight, "states", None)
    if states is None:
        return int(in_flight) * sum(per_chunk.values()) + _w_wait(in_flight) * sum(back.values())
    return max(sum(st.get(c, (0, 0))[0] * per_chunk.get(c, 0)
                   + st.get(c, (0, 0))[1] * back.get(c, 0) for c in {*per_chunk, *back})
               for st in states)


def _weights(layers: list[LayerMem], in_flight: int) -> list[tuple[list[int], list[int]]]:
    """Per state of ``in_flight``, each layer's ``(held, waiting_w)`` multipliers."""
    states = getattr(in_flight, "states", None)
    if states is None:
        n, w = int(in_flight), _w_wait(in_flight)
        return [([n] * len(layers), [w] * len(layers))]
    known = {c for st in states for c in st}
    missing = sorted({x.chunk for x in layers} - known)
    if missing:
        raise ValueError(f"layers of chunks {missing} are not in this rank's chunks "
                         f"{sorted(known)}")
    return [([st.get(x.chunk, (0, 0))[0] for x in layers],
             [st.get(x.chunk, (0, 0))[1] for x in layers]) for st in states]


def _policy(policies: dict[int, str], layer: int) -> str:
    p = policies.get(layer, "keep")
    if p not in POLICIES:
        raise ValueError(f"layer {layer}: policy must be one of {POLICIES}, got {p!r}")
    return p


def required_bytes(layers: list[LayerMem], policies: dict[int, str], in_flight: int) -> int:
    """Peak activation bytes of a stage under ``policies``.

    Args:
        layers, policies, in_flight: see the module.

    Returns:
        ``in_flight * sum(held) + transient`` (plus, under a split backward, what waits for
        ``W``: see :class:`InFlight`).
    """
    transient = 0
    held, returned = [], []
    for x in layers:
        keep = _policy(policies, x.layer) == "keep"
        held.append(x.input_bytes + (x.saved_bytes if keep else 0))
        transient = transient if keep else max(transient, x.saved_bytes)
        returned.append(0 if keep else x.saved_bytes)
    return transient + max(sum(f * h + w * r for f, w, h, r in zip(fs, ws, held, returned,
                                                                   strict=True))
                           for fs, ws in _weights(layers, in_flight))


def added_time(layers: list[LayerMem], policies: dict[int, str], host_bandwidth: float) -> float:
    """Seconds per micro-batch that ``policies`` add to the stage.

    Args:
        layers, policies, host_bandwidth: see the module.

    Returns:
        Recompute time plus the swap time not hidden behind ``T``.
    """
    threshold = sum(x.forward_s + x.backward_s for x in layers)
    chosen = {x.layer: _policy(policies, x.layer) for x in layers}
    recompute = sum(x.forward_s for x in layers if chosen[x.layer] == "recompute")
    swap = sum(x.saved_bytes / host_bandwidth for x in layers if chosen[x.layer] == "swap")
    return recompute + max(0.0, swap - threshold)


def needs_optimising(layers: list[LayerMem], policies: dict[int, str], in_flight: int,
                     limit_bytes: int | None) -> str | None:
    """The adaptive pipeline's trigger: over the limit, or a needless recompute below it.

    Args:
        layers, policies, in_flight, limit_bytes: see the module.

    Returns:
        A one-line reason to re-plan, or None when the current policies should stay.
    """
    need = required_bytes(layers, policies, in_flight)
    if limit_bytes is not None and need >= limit_bytes:
        return f"over the limit: required {format_bytes(need)} >= limit {format_bytes(limit_bytes)}"
    recomputed = [x.layer for x in layers if _policy(policies, x.layer) == "recompute"]
    if recomputed:
        below = "" if limit_bytes is None else f" < limit {format_bytes(limit_bytes)}"
        return (f"needless recompute: required {format_bytes(need)}{below} "
                f"with layers {recomputed} recomputed")
    return None


def min_feasible_bytes(layers: list[LayerMem], in_flight: int) -> int:
    """The smallest ``limit_bytes`` that some assignment of policies fits strictly below.

    For a transient ``m``, every layer saving more than ``m`` must be kept and the others can
    all be non-keep, so the best plan keeps the ``k`` largest layers for some ``k``. With
    ``in_flight >= 1`` that is ``k = 0`` (nothing kept); with ``in_flight = 0``, all kept.

    Args:
        layers, in_flight: see the module.

    Returns:
        ``min over policies of required_bytes``, plus 1.
    """
    _check(layers, in_flight)
    if getattr(in_flight, "states", None) is None:
        saved = sorted((x.saved_bytes for x in layers), reverse=True) + [0]
        w = _w_wait(in_flight)
        best = min(in_flight * sum(saved[:k]) + w * sum(saved[k:]) + saved[k]
                   for k in range(len(saved)))
        return in_flight * sum(x.input_bytes for x in layers) + best + 1
    # per chunk: not keeping a layer never costs more than keeping it (waiting_w <= held)
    # but for the transient, so the best plan still keeps the k largest layers, some k
    order = sorted(layers, key=lambda x: -x.saved_bytes)
    return 1 + min(required_bytes(layers, {x.layer: "keep" if i < k else "recompute"
                                           for i, x in enumerate(order)}, in_flight)
                   for k in range(len(order) + 1))


def _require_feasible(layers: list[LayerMem], in_flight: int, limit_bytes: int | None) -> None:
    need = min_feasible_bytes(layers, in_flight)
    if limit_bytes is not None and limit_bytes < need:
        raise PlanError(
            f"stage needs at least {format_bytes(need)} ({need} bytes) even with every layer "
            f"recomputed, but the limit is {format_bytes(limit_bytes)} ({limit_bytes} bytes); "
            f"raise memory.limit to at least {need} bytes or use more pipeline stages")


def greedy_plan(layers: list[LayerMem], in_flight: int, limit_bytes: int | None,
                host_bandwidth: float, reason: str = "") -> MemoryPlan:
    """The adaptive pipeline's rule: swap by descending swap/recompute cost ratio, then recompute.

    Layers saving nothing stay kept. The others are sorted by ``swap_cost / forward_s``
    descending (``forward_s == 0`` first; ties in the order of ``layers``) and swapped one by
    one until the swapped cost is no longer ``< T`` (the crossing layer is swapped). While the
    stage does not fit, the next layers in that order are recomputed one at a time (never
    when ``limit_bytes`` is None).

    Args:
        layers, in_flight, limit_bytes, host_bandwidth, reason: see the module.

    Returns:
        The plan, which may still not fit: callers check ``required_bytes < limit_bytes``.

    Raises:
        ValueError: malformed layers or a non-positive bandwidth.
    """
    _check(layers, in_flight, host_bandwidth)
    threshold = sum(x.forward_s + x.backward_s for x in layers)
    ratio = lambda x: math.inf if x.forward_s == 0 else x.saved_bytes / host_bandwidth / x.forward_s
    order = sorted((x for x in layers if x.saved_bytes > 0), key=lambda x: -ratio(x))
    policies, swapped, swap_s = {}, 0, 0.0
    for x in order:
        policies[x.layer], swapped = "swap", swapped + 1
        swap_s += x.saved_bytes / host_bandwidth
        if swap_s >= threshold:
            break
    for x in order[swapped:] if limit_bytes is not None else ():
        if required_bytes(layers, policies, in_flight) < limit_bytes:
            break
        policies[x.layer] = "recompute"
    return MemoryPlan.build(layers, policies, in_flight, limit_bytes, host_bandwidth, "greedy",
                            reason)


def optimal_plan(layers: list[LayerMem], in_flight: int, limit_bytes: int | None,
                 host_bandwidth: float, reason: str = "") -> MemoryPlan:
    """The plan of least added time that fits, as a MILP solved by HiGHS.

    Binaries ``k, s, r`` per layer (one of them 1); ``E >= sum(s * swap_cost) - T, E >= 0``;
    ``M >= saved * (s + r)`` per layer; ``in_flight * sum(k * saved + input) + M <= limit - 1``
    (one such row per state of a :class:`ChunkInFlight`, each layer weighted by its chunk);
    minimise ``sum(r * forward_s) + E``; bytes in MiB, time in ``scale / 1e6`` where ``scale =
    sum(forward_s) + sum(swap_cost)``. Tie-break, lexicographic (a weighted one that small
    drowns in HiGHS's tolerances): a second solve minimises ``#swap + 2 * #recompute`` (keep
    beats swap beats recompute) within ``1e-9 * scale`` of the first's added time; its plan is
    taken only if its exact added time is within that bound, so ties never cost more than
    ``1e-9 * scale``. Solutions are checked in exact bytes. ``limit_bytes`` None keeps all.

    Args:
        layers, in_flight, limit_bytes, host_bandwidth, reason: see the module.

    Returns:
        A plan with ``required_bytes < limit_bytes``.

    Raises:
        PlanError: no assignment fits (message as :func:`plan_stage`), or the solver failed.
        ValueError: malformed layers or a non-positive bandwidth.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp  # the greedy path needs no scipy

    _check(layers, in_flight, host_bandwidth)
    _require_feasible(layers, in_flight, limit_bytes)
    if limit_bytes is None or not layers:
        return MemoryPlan.build(layers, {}, in_flight, limit_bytes, host_bandwidth, "optimal",
                                reason)
    n, eye, col = len(layers), np.eye(len(layers)), np.zeros((len(layers), 1))
    saved = np.array([x.saved_bytes for x in layers], dtype=float) / _MIB
    fwd = np.array([x.forward_s for x in layers], dtype=float)
    swap = saved * _MIB / host_bandwidth
    threshold = sum(x.forward_s + x.backward_s for x in layers)
    scale = float(fwd.sum() + swap.sum()) or 1.0
    unit = _TIME_UNITS / scale
    # variables: k (n), s (n), r (n), E, M
    time_c = np.concatenate([0 * fwd, 0 * fwd, fwd * unit, [1.0, 0.0]])
    count_c = np.concatenate([0 * fwd, 0 * fwd + 1, 0 * fwd + 2, [0.0, 0.0]])
    base = [
        LinearConstraint(np.hstack([eye, eye, eye, col, col]), 1, 1),
        LinearConstraint(np.concatenate([0 * fwd, swap * unit, 0 * fwd, [-1.0, 0.0]])[None, :],
                         -np.inf, threshold * unit),
        LinearConstraint(np.hstack([0 * eye, np.diag(saved), np.diag(saved), col, col - 1]),
                         -np.inf, 0),
    ]
    weights = [(np.array(f, dtype=float), np.array(w, dtype=float))
               for f, w in _weights(layers, in_flight)]
    # one row per state of in_flight (one with one chunk per rank): held and brought back
    memory = np.array([np.concatenate([f * saved, w * saved, w * saved, [0.0, 1.0]])
                       for f, w in weights])
    inputs = np.array([x.input_bytes for x in layers], dtype=float)
    fixed = np.array([float(f @ inputs) for f, _ in weights])
    # finite (valid) bounds on E and M: with them unbounded HiGHS's presolve mis-prunes ties
    e_max, m_max = max(0.0, float(swap.sum()) - threshold) * unit, float(saved.max())
    bounds = Bounds(np.zeros(3 * n + 2), np.concatenate([np.ones(3 * n), [e_max, m_max]]))
    integrality = np.concatenate([np.ones(3 * n), [0, 0]])

    def solve(c: np.ndarray, extra: list) -> dict[int, str] | None:
        cap = limit_bytes - 1 - fixed
        for _ in range(3):
            constraints = [*base, *extra, LinearConstraint(memory, -np.inf, cap / _MIB)]
            res = milp(c, integrality=integrality, bounds=bounds, constraints=constraints,
                       options={"mip_rel_gap": 1e-12})
            if res.x is None:
                return None
            choice = res.x[: 3 * n].reshape(3, n).argmax(axis=0)
            policies = {x.layer: POLICIES[int(i)] for x, i in zip(layers, choice, strict=True)}
            over = required_bytes(layers, policies, in_flight) - (limit_bytes - 1)
            if over <= 0:
                return policies
            cap -= over  # the solver's tolerance let a plan bytes over through: tighten, retry
        return None

    best = solve(time_c, [])
    if best is None:
        raise PlanError("the memory MILP found no plan although one exists; use planner 'greedy'")
    bound = added_time(layers, best, host_bandwidth) + _TIE_BREAK * scale
    tied = solve(count_c, [LinearConstraint(time_c[None, :], -np.inf, bound * unit)])
    if tied is not None and added_time(layers, tied, host_bandwidth) <= bound:
        best = tied
    return MemoryPlan.build(layers, best, in_flight, limit_bytes, host_bandwidth, "optimal",
                            reason)


def plan_stage(layers: list[LayerMem], in_flight: int, limit_bytes: int | None,
               host_bandwidth: float, planner: str = "greedy",
               current: dict[int, str] | None = None) -> MemoryPlan | None:
    """Re-plan a stage's policies when the trigger fires (:func:`needs_optimising`).

    Args:
        layers, in_flight, limit_bytes, host_bandwidth: see the module.
        planner: ``"greedy"`` or ``"optimal"``.
        current: the policies in use; None means every layer kept.

    Returns:
        None when the current policies stay (:func:`needs_optimising` says no), else the new
        plan, whose ``reason`` is the trigger's reason.

    Raises:
        PlanError: even the smallest footprint is not below ``limit_bytes``; the message gives
            the smallest feasible limit.
        ValueError: unknown planner, malformed layers or policies.
    """
    if planner not in ("greedy", "optimal"):
        raise ValueError(f"planner must be 'greedy' or 'optimal', got {planner!r}")
    _check(layers, in_flight, host_bandwidth)
    reason = needs_optimising(layers, current or {}, in_flight, limit_bytes)
    if reason is None:
        return None
    _require_feasible(layers, in_flight, limit_bytes)
    make = greedy_plan if planner == "greedy" else optimal_plan
    return make(layers, in_flight, limit_bytes, host_bandwidth, reason=reason)


def format_bytes(n: int) -> str:
    """Human-readable binary size.

    Args:
        n: a number of bytes.

    Returns:
        E.g. ``"512 B"``, ``"1.5 GiB"`` (one decimal from KiB up, TiB at most).
    """
    size, sign, unit = float(abs(n)), "-" if n < 0 else "", "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{sign}{int(size)} B" if unit == "B" else f"{sign}{size:.1f} {unit}"
