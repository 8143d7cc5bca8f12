"""What a step costs beyond the profile: per-action overhead and ranks sharing cores.

A profile times each layer's forward and backward alone, in one process. A pipeline step
also pays for

* **actions**: each ``F``/``B``/``W`` runs the stage's bookkeeping (store, hooks, loss)
  once, plus one autograd **segment** launch per layer (inputs detached, graph kept);
  each ``SEND_*`` posts a header and payloads; each ``RECV_*`` decodes a header and posts
  the payload receives after it arrives (a second round trip the link model's one latency
  does not see);
* **delivery**: a message to a rank that waits for it arrives later than the link's
  latency and bandwidth say once several ranks share the host: the sender goes back to
  computing and its transport thread, and the woken receiver, wait for a core (tails of
  the scheduler's tick, several ms). ``delivery_s[w]`` is the mean extra of one message
  in a chain of ``w`` ranks, each receiving, computing and sending on, as a pipeline's
  ranks do;
* **shared cores**: ``k`` ranks computing at once on a host with fewer than ``k`` free
  cores each run slower than alone (and even under the core count, memory bandwidth and
  caches are shared). ``slowdown[k]`` is the per-rank time factor of ``k`` concurrent
  ranks of compute, 1 at ``k = 1``;
* **transport threads**: the backend moves each message on threads of its own, whose CPU
  the ranks' compute shares: ``transport_s + transport_s_per_byte * bytes`` at each end
  (gloo on the 2-core host, messages one at a time: 0.6-0.9 ms, nearly flat in the bytes:
  a wake-up more than a copy).

With the transport measured, :meth:`Calibration.sharing` gives the processor-sharing
replay's terms (:mod:`~trainwright.plan.sharing`) and the simulator takes a step's times
from it, with the delivery of a chain no longer than the host's cores (the wake-up of a
waiting rank; longer chains' extra is the sharing the replay models); ``slowdown`` and the
longer chains' ``delivery_s`` remain for what that replay does not model (peer swap).

Every term is measured on the machine (:mod:`trainwright.bench.calibrate` takes the
timings); this module only fits them (pure functions over lists of seconds, testable with
injected timings) and applies them to simulator costs. The fitted :class:`Calibration` is
cached per machine as JSON with the host it was measured on; a cache from another host
is not used.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainwright.errors import PlanError
from trainwright.plan.sharing import Sharing
from trainwright.schedule.base import ActionKind

__all__ = ["METHOD", "Calibration", "fit_overhead", "fit_delivery", "fit_slowdown",
           "fit_increasing", "fit_transport", "count_segments", "with_overheads",
           "with_delivery", "scaled", "load", "save", "default_path"]


METHOD = 4
"""The measuring method's version: a cache measured by an older one is measured again
(2: the shared-core slowdown from whole batches of work, not single short units; 3: the
delivery of a message in a chain of ranks; 4: the transport threads' CPU per message, for
the processor-sharing replay)."""


@dataclass
class Calibration:
    """Measured step-time terms of one machine (seconds; factors)."""

    host: dict
    """Where it was measured (:func:`trainwright.bench.paired.host_info`)."""
    cores: int
    action_s: float = 0.0
    """Per ``F``/``B``/``W`` action of a stage, beyond its layers' profiled times."""
    segment_s: float = 0.0
    """Per layer segment launched by an ``F``/``B``/``W`` action."""
    send_s: float = 0.0
    """Per ``SEND_F``/``SEND_B``: posting header and payload."""
    recv_s: float = 0.0
    """Per ``RECV_F``/``RECV_B``, beyond the link model's ``latency + bytes / bandwidth``."""
    slowdown: dict = field(default_factory=lambda: {1: 1.0})
    """Concurrent computing ranks ``k`` -> per-rank time factor (1.0 at ``k = 1``)."""
    delivery_s: dict = field(default_factory=dict)
    """Ranks ``w`` on the host passing messages along a chain -> mean seconds one message
    to a waiting rank takes beyond the link model's ``latency + bytes / bandwidth`` and
    :attr:`recv_s` (empty: not measured, no extra)."""
    transport_s: float | None = None
    """CPU seconds of the backend's transport threads per message at each end, beyond
    :attr:`transport_s_per_byte` (None: not measured; the ``slowdown`` model is used)."""
    transport_s_per_byte: float = 0.0
    method: int = METHOD
    """The :data:`METHOD` it was measured with."""

    def sharing(self, inflation: float = 1.0, copy_inflation: float = 1.0) -> Sharing | None:
        """The processor-sharing replay's terms on this host (None when the transport was
        not measured).

        Args:
            inflation: compute's time under sharing over its profile
                (:attr:`~trainwright.plan.sharing.Sharing.inflation`; a model's, measured
                by a run of it, not the machine's).
            copy_inflation: a host-swapped stage's copies under sharing over their
                single-process time (:attr:`~trainwright.plan.sharing.Sharing.copy_inflation`;
                likewise a model's).
        """
        if self.transport_s is None:
            return None
        return Sharing(self.cores, self.transport_s, self.transport_s_per_byte, inflation,
                       copy_inflation)

    def factor(self, k: float) -> float:
        """Time factor of ``k`` (possibly fractional) concurrent ranks: linear between the
        measured counts, extended along the last two points' line past the largest."""
        return _interpolate(self.slowdown, k, extend=True)

    def delivery(self, ranks: float) -> float:
        """Extra seconds per message among ``ranks`` ranks on the host: linear between the
        measured chains, the nearest one's outside them (a mean of heavy-tailed delays is
        not extended along a line); 0 for one rank or when not measured."""
        if ranks < 2 or not self.delivery_s:
            return 0.0
        return _interpolate(self.delivery_s, ranks, extend=False)

    def describe(self) -> str:
        """One line: the overheads in microseconds and the slowdown per rank count."""
        us = "/".join(f"{x * 1e6:.0f}" for x in (self.action_s, self.segment_s, self.send_s,
                                                   self.recv_s))
        slow = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(self.slowdown.items()))
        late = ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in sorted(self.delivery_s.items()))
        moved = "not measured" if self.transport_s is None else \
            f"{self.transport_s * 1e6:.0f} us + {self.transport_s_per_byte * 2**30:.2f} s/GiB"
        return (f"action/segment/send/recv {us} us, slowdown by concurrent ranks {{{slow}}}, "
                f"delivery ms by ranks {{{late}}}, transport CPU per message end {moved}")

    def to_dict(self) -> dict:
        """JSON view (slowdown keys as strings)."""
        d = dataclasses.asdict(self)
        for name in ("slowdown", "delivery_s"):
            d[name] = {str(k): v for k, v in sorted(d[name].items())}
        return d

    @classmethod
    def median_of(cls, takes: Sequence[Calibration]) -> Calibration:
        """One calibration from several takes at different moments: every term the median
        of the takes' (per rank count for ``slowdown`` and ``delivery_s``; a count some
        take lacks, of those that have it); the host and method of the last. One take of
        the receive overhead read 1.15 ms in a planner sweep (2026-12-08) where takes a
        few minutes apart read 0.09-0.21 ms, and every two-chunk schedule's prediction,
        with many receives per step, moved with it."""
        if not takes:
            raise ValueError("median_of needs at least one calibration")
        med = statistics.median
        last = takes[-1]

        def per_count(name: str) -> dict:
            keys = sorted({k for t in takes for k in getattr(t, name)})
            return {k: med(getattr(t, name)[k] for t in takes if k in getattr(t, name))
                    for k in keys}

        moved = [t.transport_s for t in takes if t.transport_s is not None]
        return dataclasses.replace(
            last, **{name: med(getattr(t, name) for t in takes)
               for name in ("action_s", "segment_s", "send_s", "recv_s",
                            "transport_s_per_byte")},
            slowdown=per_count("slowdown"), delivery_s=per_count("delivery_s"),
            transport_s=med(moved) if moved else None)

    @classmethod
    def from_dict(cls, d: Mapping) -> Calibration:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["slowdown"] = {int(k): float(v) for k, v in d.get("slowdown", {1: 1.0}).items()}
        d["delivery_s"] = {int(k): float(v) for k, v in d.get("delivery_s", {}).items()}
        return cls(**d)


def _interpolate(points: Mapping, x: float, extend: bool) -> float:
    """Piecewise-linear ``points`` (count -> value) at ``x``; below the first count its
    value; past the last, along the last two points' line if ``extend`` else the last."""
    pts = sorted((int(a), float(b)) for a, b in points.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (k0, f0), (k1, f1) in zip(pts, pts[1:], strict=False):
        if x <= k1:
            return f0 + (f1 - f0) * (x - k0) / (k1 - k0)
    if len(pts) == 1 or not extend:
        return pts[-1][1]
    (k0, f0), (k1, f1) = pts[-2], pts[-1]
    return f1 + (f1 - f0) / (k1 - k0) * (x - k1)


def fit_overhead(action_s_by_segments: Mapping[int, Sequence[float]],
                 profiled_s_by_segments: Mapping[int, float]) -> tuple[float, float]:
    """Per-action and per-segment overhead from actions timed at several segment counts.

    Args:
        action_s_by_segments: segments per action -> measured action seconds.
        profiled_s_by_segments: segments per action -> the profile's summed layer seconds
            for the same work.

    Returns:
        ``(action_s, segment_s)``: least squares of ``median(measured) - profiled =
        action_s + segments * segment_s``, each clamped at 0 (a negative overhead is
        noise, not a speed-up to predict).

    Raises:
        PlanError: fewer than two segment counts, or one without timings.
    """
    ns = sorted(action_s_by_segments)
    if len(ns) < 2 or any(not action_s_by_segments[n] for n in ns):
        raise PlanError(f"fitting per-action and per-segment overhead needs timings at two or "
                        f"more segment counts; got {ns}: time actions of 1 and several layers")
    ys = [statistics.median(action_s_by_segments[n]) - profiled_s_by_segments[n] for n in ns]
    mx, my = statistics.fmean(ns), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(ns, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in ns)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def fit_delivery(delays_by_ranks: Mapping[int, Sequence[float]], plain_s: float,
                 recv_s: float) -> dict[int, float]:
    """``w -> mean(delays of a w-rank chain) - plain_s - recv_s``, at least 0.

    Args:
        delays_by_ranks: chain length -> seconds from a message's send (or the receive's
            start, if later) until the receive returned, one per message.
        plain_s: a plain receive of the same bytes between two idle ranks (what the link
            model's ``latency + bytes / bandwidth`` charges).
        recv_s: the per-receive overhead already charged (:attr:`Calibration.recv_s`).

    The mean, not the median: a step waits for every message on its critical path, and the
    delays' tail (a scheduler tick, several ms) is most of their sum.
    """
    return {w: max(statistics.fmean(v) - plain_s - recv_s, 0.0)
            for w, v in sorted(delays_by_ranks.items()) if v}


def fit_slowdown(times_by_ranks: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """``k -> median(time of one unit of work with k ranks at once) / median(alone)``.

    Raises:
        PlanError: no timings of one rank alone (the reference).
    """
    if not times_by_ranks.get(1):
        raise PlanError("the shared-core slowdown needs timings of one rank alone (k = 1) "
                        f"as reference; got counts {sorted(times_by_ranks)}")
    alone = statistics.median(times_by_ranks[1])
    return {k: statistics.median(v) / alone for k, v in sorted(times_by_ranks.items()) if v}


def fit_transport(cpu_s_by_bytes: Mapping[int, float]) -> tuple[float, float]:
    """``(transport_s, transport_s_per_byte)``: the line through the transport's CPU
    seconds per message end at the smallest and the largest message, the slope and the
    intercept each at least 0 (a message costs no less for being larger).

    Raises:
        PlanError: fewer than two message sizes.
    """
    if len(cpu_s_by_bytes) < 2:
        raise PlanError(f"fitting the transport's CPU per message needs two message sizes or "
                        f"more; got {sorted(cpu_s_by_bytes)}")
    small, big = min(cpu_s_by_bytes), max(cpu_s_by_bytes)
    per_byte = max(cpu_s_by_bytes[big] - cpu_s_by_bytes[small], 0.0) / (big - small)
    return max(cpu_s_by_bytes[small] - small * per_byte, 0.0), per_byte


def fit_increasing(predict: Callable[[float], float], measured: float, lo: float,
                   hi: float, rounds: int = 40) -> float:
    """The ``x`` in ``[lo, hi]`` at which ``predict(x)``, non-decreasing in ``x``, equals
    ``measured`` (bisection; ``lo`` or ``hi`` when the measurement lies outside what the
    range predicts). Fits a replay's term to a timed run of the same work (a model's
    compute inflation under shared cores)."""
    if predict(lo) >= measured:
        return lo
    if predict(hi) <= measured:
        return hi
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if predict(mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


def count_segments(layers: Sequence[int], policies: Mapping[int, str]) -> int:
    """Autograd segments one compute action of ``layers`` launches on a fused step
    (``trainwright run`` without pending plan changes): each run of consecutive kept layers
    is one, every other layer one of its own.

    Args:
        layers: the stage's layer indices, in order.
        policies: layer -> memory policy; a layer not named is kept.
    """
    n, prev_keep = 0, False
    for i in layers:
        keep = policies.get(i, "keep") == "keep"
        n += not (keep and prev_keep)
        prev_keep = keep
    return n


def with_overheads(costs: list, segments: Sequence[int], cal: Calibration) -> list:
    """Copies of simulator ``costs`` whose ``action_s`` carry the calibrated overheads.

    Args:
        costs: :class:`~trainwright.plan.simulate.StageCost` per (model) stage.
        segments: autograd segments each stage's compute action launches (its layers).
        cal: the machine's terms.
    """
    out = []
    for c, n in zip(costs, segments, strict=True):
        extra = dict.fromkeys(_COMPUTE, cal.action_s + n * cal.segment_s)
        extra.update(dict.fromkeys(_SENDS, cal.send_s))
        extra.update(dict.fromkeys(_RECVS, cal.recv_s))
        acts = dict(c.action_s)
        for k, v in extra.items():
            acts[k] = acts.get(k, 0.0) + v
        out.append(dataclasses.replace(c, action_s=acts))
    return out


def with_delivery(links, cal: Calibration | None, ranks: int):
    """A copy of simulator ``links`` that delays messages between ranks by the calibrated
    delivery among ``ranks`` ranks sharing the host (``links`` itself without ``cal``); with
    the transport measured (the processor-sharing replay, which models the sharing), among
    at most as many ranks as the host has cores."""
    if cal is None:
        return links
    if cal.transport_s is not None:
        ranks = min(ranks, cal.cores)
    return dataclasses.replace(links, delivery_s=cal.delivery(ranks))


_SCALED = ("forward_s", "backward_s", "weight_s", "step_s")


def scaled(costs: list, f: float) -> list:
    """Copies of ``costs`` whose CPU work (compute, optimizer step, action overheads) takes
    ``f`` times as long: ranks sharing cores (:meth:`Calibration.factor`)."""
    out = []
    for c in costs:
        kw = {k: getattr(c, k) * f for k in _SCALED}
        kw["action_s"] = {k: v * f for k, v in c.action_s.items()}
        for name in ("mb_forward_s", "mb_backward_s"):
            kw[name] = {k: v * f for k, v in getattr(c, name).items()}
        for name in ("layer_forward_s", "layer_backward_s"):
            kw[name] = [v * f for v in getattr(c, name)]
        out.append(dataclasses.replace(c, **kw))
    return out


def default_path() -> Path:
    """``~/.cache/trainwright/calibration.json``."""
    return Path.home() / ".cache" / "trainwright" / "calibration.json"


def _same_host(a: Mapping, b: Mapping) -> bool:
    keys = ("cpu_model", "cpu_id", "cpus", "platform", "torch")
    return all(a.get(k) == b.get(k) for k in keys)


def load(path: Path, host: Mapping) -> Calibration | None:
    """The calibration cached at ``path`` if it was measured on ``host`` by this
    :data:`METHOD`, else None."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if d.get("method", 1) != METHOD:
        return None
    cal = Calibration.from_dict(d)
    return cal if _same_host(cal.host, host) else None


def save(path: Path, cal: Calibration) -> None:
    """Write ``cal`` to ``path`` (whole file or nothing: via a temporary beside it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=1))
    tmp.replace(path)
