"""How long a step waits for late nodes once the quorum is in: the adaptive grace.

A fixed grace (the old 20 ms) is either too long (every step with a real straggler pays it
in full on every fast node) or too short (on a busier host the last on-time node misses it
and its shard waits a step). The grace is instead read from the step's own arrivals:

* every node announces when its gradient for a step is ready (a ``want`` message, a few
  bytes), so every member sees the readiness times of all the others on its own clock;
* the *spread* of a step is the time from the first readiness to the one that completed the
  quorum (``contributors_needed`` of them): how far apart nodes that are on time arrive;
* the grace is ``factor x`` the median spread of the last ``window`` steps, at most
  ``cap_s`` (``tokenring.close_grace_s``); before any step was measured it is ``cap_s``.

A node that is ready but not yet added (it announced itself, the token is on its way) is
never cut off: the close rule waits for it whatever the grace
(:meth:`~trainwright.tokenring.ring.TokenRing._may_close`). With no straggler every node is
ready inside the spread, the last contribution closes the step at once, and the grace adds
nothing.

Pure bookkeeping on an injected clock's readings: no sockets, no threads.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["AdaptiveGrace", "GRACE_FACTOR", "GRACE_WINDOW"]

GRACE_FACTOR = 2.0
"""Grace = this many times the on-time nodes' arrival spread."""
GRACE_WINDOW = 8
"""Steps whose spreads the median is taken over."""


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

    def ready(self, step: int, node: int, at: float) -> None:
        """Node ``node`` said (or showed, by contributing) its gradient of ``step`` is ready
        at ``at``; only the first report counts."""
        self._ready.setdefault(step, {}).setdefault(node, at)

    def is_ready(self, step: int, node: int) -> bool:
        """Whether ``node`` reported its gradient of ``step`` ready."""
        return node in self._ready.get(step, {})

    def measure(self, step: int, quorum: int) -> float | None:
        """Record ``step``'s spread once ``quorum`` nodes were ready (once per step).

        Returns:
            The spread in seconds, or None (fewer than ``quorum`` ready, or measured already).
        """
        times = sorted(self._ready.get(step, {}).values())
        if step in self._measured or len(times) < quorum:
            return None
        self._measured.add(step)
        spread = times[quorum - 1] - times[0]
        self.spreads.append(spread)
        return spread

    def grace_s(self) -> float:
        """The grace for the next close: ``factor x`` median spread, at most ``cap_s``."""
        if not self.spreads:
            return self.cap_s
        return min(self.cap_s, self.factor * statistics.median(self.spreads))

    def forget(self, before: int) -> None:
        """Drop what was recorded for steps before ``before``."""
        for s in [s for s in self._ready if s < before]:
            del self._ready[s]
        self._measured = {s for s in self._measured if s >= before}
