"""How long a step waits for late nodes once the quorum is in: the adaptive grace.

A fixed grace (the old 20 ms) is either too long (every step with a real straggler pays it
in full on every fast node) or too short (on a busier host the last on-time node misses it
and its shard waits a step). The grace is instead read from the step's own arrivals:

* every node announces when its gradient for a step is ready (a ``want`` message, a few
  bytes), so every member sees the readiness times of all the others on its own clock;
* the *spread* of a step is the time from its first readiness to the last one within
  ``cap_s`` of it, or to the one that completed the quorum (``contributors_needed`` of
  them) if that came later: how far apart the nodes that are on time arrive. It is
  measured once every member is ready, or ``cap_s`` after the first readiness; until the
  first step is, the spread of the arrivals so far stands for it (each on-time node that
  arrives lengthens the first step's grace: nodes start the first step as their welcome
  arrives, up to 15 ms apart, and the spread to the quorum alone cut one off there in the
  benchmark's first round). (It was the
  time to the quorum alone until 2026-12-07: nodes start a step when the closed sum reaches
  them, one hop after another, so on-time nodes arrive staggered by the pass; the quorum's
  first two, 3-4 ms apart at 4 nodes, made a grace that cut off the last on-time node,
  12 ms behind, in 1-7 of 40-50 steps with no straggler at all, and its shard went to a later
  step: 31-33 steps to the target against DDP's 31);
* the grace is ``factor x`` the median spread of the last ``window`` steps, at most
  ``cap_s`` (``tokenring.close_grace_s``); before any step was measured it is ``factor x``
  the spread of the arrivals so far (``cap_s`` until a quorum is ready).

A node that is ready but not yet added (it announced itself, the token is on its way) is
never cut off: the close rule waits for it whatever the grace
(:meth:`~trainwright.tokenring.ring.TokenRing._may_close`). With no straggler every node is
ready inside the spread, the last contribution closes the step at once, and the grace adds
nothing.

The grace is for nodes a little late; a node that is far behind in step after step (a
slower machine) would otherwise cost every step the whole grace for nothing. So a member
that missed each of the last ``LATE_STEPS`` closes by more than ``cap_s`` (it said it was
ready later than that after the close, or never: a node that finds its step closed before
its gradient is ready still says so, :meth:`~trainwright.tokenring.ring.TokenRing.late`)
is *known late* (:meth:`AdaptiveGrace.known_late`), and a step whose missing members are all
known late closes at the quorum. One step in which it is ready before the close, or
within ``cap_s`` after it, and the grace waits for it again.

Pure bookkeeping on an injected clock's readings: no sockets, no threads.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["AdaptiveGrace", "GRACE_FACTOR", "GRACE_WINDOW", "LATE_STEPS"]

GRACE_FACTOR = 2.0
"""Grace = this many times the on-time nodes' arrival spread."""
GRACE_WINDOW = 8
"""Steps whose spreads the median is taken over."""
LATE_STEPS = 3
"""Closes in a row a member must miss by more than the cap to count as known late."""


class AdaptiveGrace:
    """Readiness times per step and the grace they imply.

    Args:
        cap_s: the longest grace (``tokenring.close_grace_s``); 0 closes at the quorum.
        factor: grace = ``factor`` x the median recent spread.
        window: steps in the median.
    """

    def __init__(self, cap_s: float, factor: float = GRACE_FACTOR, window: int = GRACE_WINDOW):
        if cap_s < 0 or factor <= 0 or window < 1:
            raise ValueError(f"AdaptiveGrace(cap_s={cap_s}, factor={factor}, window={window}): "
                             f"need cap_s >= 0, factor > 0, window >= 1")
        self.cap_s, self.factor = cap_s, factor
        self.spreads: deque[float] = deque(maxlen=window)
        self._ready: dict[int, dict[int, float]] = {}
        self._measured: set[int] = set()
        self._provisional: float | None = None
        """Before any spread is recorded: the largest spread of the arrivals so far (each
        on-time arrival after the quorum lengthens the first step's grace)."""
        self._closed: dict[int, tuple[float, frozenset[int]]] = {}
        """Per closed step: when it closed here, and the members missing from it."""

    def ready(self, step: int, node: int, at: float) -> None:
        """Node ``node`` said (or showed, by contributing) its gradient of ``step`` is ready
        at ``at``; only the first report counts."""
        self._ready.setdefault(step, {}).setdefault(node, at)

    def is_ready(self, step: int, node: int) -> bool:
        """Whether ``node`` reported its gradient of ``step`` ready."""
        return node in self._ready.get(step, {})

    def measure(self, members: int, quorum: int, now: float) -> list[float]:
        """Record the spread of every step whose on-time arrivals are all in: each of its
        ``members`` is ready, or ``cap_s`` has passed since its first readiness and
        ``quorum`` nodes are ready (once per step, in step order).

        Returns:
            The spreads recorded by this call, in seconds.
        """
        got = []
        for step in sorted(s for s in self._ready if s not in self._measured):
            times = sorted(self._ready[step].values())
            if len(times) < quorum:
                continue
            spread = max(max(t for t in times if t - times[0] <= self.cap_s),
                         times[quorum - 1]) - times[0]
            self._provisional = max(self._provisional or 0.0, spread)  # so far
            if len(times) < members and now - times[0] < self.cap_s:
                continue
            self._measured.add(step)
            got.append(spread)
        self.spreads.extend(got)
        return got

    def grace_s(self) -> float:
        """The grace for the next close: ``factor x`` median spread, at most ``cap_s``."""
        if not self.spreads:
            return self.cap_s if self._provisional is None else min(
                self.cap_s, self.factor * self._provisional)
        return min(self.cap_s, self.factor * statistics.median(self.spreads))

    def closed(self, step: int, at: float, missing) -> None:
        """``step`` closed at ``at`` without the members ``missing`` (once per step)."""
        self._closed.setdefault(step, (at, frozenset(missing)))

    def known_late(self, node: int, now: float) -> bool:
        """Whether ``node`` missed each of the last :data:`LATE_STEPS` closes whose verdict is
        in (closed at least ``cap_s`` before ``now``) by more than ``cap_s``: absent from
        the close, and ready only later than ``cap_s`` after it, or never."""
        final = sorted((s for s, (at, _) in self._closed.items() if now - at >= self.cap_s),
                       reverse=True)[:LATE_STEPS]
        if len(final) < LATE_STEPS:
            return False
        for s in final:
            at, missing = self._closed[s]
            ready = self._ready.get(s, {}).get(node)
            if node not in missing or (ready is not None and ready - at <= self.cap_s):
                return False
        return True

    def forget(self, before: int) -> None:
        """Drop what was recorded for steps before ``before``."""
        for s in [s for s in self._ready if s < before]:
            del self._ready[s]
        for s in [s for s in self._closed if s < before]:
            del self._closed[s]
        self._measured = {s for s in self._measured if s >= before}
