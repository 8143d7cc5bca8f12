"""Ranks sharing the host's cores: a step replayed as processor sharing of CPU work.

When a pipeline runs more ranks than the host has cores (or its ranks' transport threads
need the cores too), a step is bounded by the CPU work of every rank and thread, not by
one rank's critical path alone. Measured on the 2-core host, 4 ranks of 1F1B with 8
micro-batches: the ranks' main threads took 302 ms of CPU per step and gloo's transport
threads 38 ms more, 1.79 of the 2 cores busy, where the profile's compute is 262 ms.

This replay takes the actions of :mod:`~trainwright.plan.simulate`'s lists in the same
order, but an action that works on the CPU is a **job** with a CPU demand, and all jobs
running at one moment share the cores equally: with ``n`` jobs on ``c`` cores each
progresses at ``min(1, c / n)`` seconds of work per second (processor sharing, the fluid
limit of the scheduler's time slices). The jobs:

* a compute action (``F``/``B``/``W``; ``STEP``): its profiled seconds times the
  calibrated ``inflation`` (compute runs slower than alone while other ranks evict its
  caches), plus its per-action overhead; on a host-swapped stage ``F`` also copies its
  activations out and ``B`` copies them back (``host_bytes / host_bandwidth`` times the
  calibrated ``copy_inflation``: copies share the memory with the other ranks' work; on the
  CPU the rank's own thread copies);
* a send or receive: the rank's own posting and decoding (``action_s``); a send's message
  leaves when its posting ends (the plain replay sends it when the posting starts);
* a message: the transport's CPU on the sender's side (``transport_s +
  transport_s_per_byte * bytes``, the backend's transport thread: a job of its own beside
  the rank's), then the link's ``latency + bytes / bandwidth`` and the links' ``delivery_s``
  (no CPU), then the transport's CPU on the receiver's side; it has arrived when that ends.

Waiting (a receive whose message has not arrived, ``SYNC`` until the rank's sends have)
takes no CPU. Peer-swap actions are not modelled here (:func:`supported` says so): their
replays keep :func:`~trainwright.plan.simulate.simulate`'s shared-core factor.

Pure: no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from trainwright.errors import PlanError
from trainwright.schedule.base import COMPUTE, PEER_KINDS, ActionKind

__all__ = ["Sharing", "SharedStep", "supported", "replay"]


@dataclass(frozen=True)
class Sharing:
    """The host the ranks share: the cores and the transport from the machine's calibration
    (:meth:`trainwright.plan.calibration.Calibration.sharing`), the inflations from runs of
    the model (1.0 without them)."""

    cores: float
    """Cores this pipeline's ranks have (a share of the host's when data-parallel
    replicas share it too)."""
    transport_s: float = 0.0
    """CPU seconds of the backend's transport thread per message at each end, beyond
    :attr:`transport_s_per_byte` times its bytes."""
    transport_s_per_byte: float = 0.0
    inflation: float = 1.0
    """A rank's compute time in a pipeline of ranks sharing the host, as the processor
    sharing sees it, over its profiled time (caches evicted by the other ranks)."""
    copy_inflation: float = 1.0
    """A host-swapped stage's copies in such a pipeline over their time at the swap's
    single-process rate (the memory's bandwidth shared with the other ranks' work)."""


@dataclass
class SharedStep:
    """What the replay found."""

    step_s: float
    timeline: list[tuple]
    """``(stage list, kind, mb, start_s, end_s)`` of every action."""
    busy_s: list[float]
    """Per list: wall seconds of its compute actions."""


_SENDS = {ActionKind.SEND_F: ("act", 1), ActionKind.SEND_B: ("grad", -1)}
_RECVS = {ActionKind.RECV_F: ("act", -1), ActionKind.RECV_B: ("grad", 1)}


def supported(schedule: list[list]) -> bool:
    """Whether :func:`replay` models every action of ``schedule`` (no peer swap)."""
    return not any(a.kind in PEER_KINDS for acts in schedule for a in acts)


def replay(schedule: list[list], costs: list, links, sharing: Sharing) -> SharedStep:
    """Replay one step of ``schedule`` under ``costs`` (one
    :class:`~trainwright.plan.simulate.StageCost` per list, or per model stage) on a host
    of ``sharing.cores`` cores.

    Raises:
        PlanError: a peer-swap action (:func:`supported`), or a deadlock.
    """
    if not supported(schedule):
        raise PlanError("the shared-core replay does not model peer swap; use simulate()")
    if sharing.cores <= 0:
        raise PlanError(f"the ranks need a share of the host's cores; got cores={sharing.cores}")
    return _SharedReplay(schedule, costs, links, sharing).run()


class _SharedReplay:
    """The state of one :func:`replay`: per list, its position and the job it waits on."""

    def __init__(self, schedule, costs, links, sharing: Sharing) -> None:
        n = len(schedule)
        self.schedule, self.costs, self.links, self.sharing = schedule, costs, links, sharing
        self.per_stage = len(costs) != n
        self.rank_of = {a.stage: s for s, acts in enumerate(schedule) for a in acts}
        self.chunks_of = [sorted({a.stage for a in acts if a.kind in COMPUTE})
                          for acts in schedule]
        self.split = [any(a.kind == ActionKind.W for a in acts) for acts in schedule]
        self.pos = [0] * n
        self.running: list[int | None] = [None] * n  # the job list s waits on
        self.started = [0.0] * n
        self.jobs: dict[int, list] = {}  # id -> [remaining CPU seconds, on_done]
        self.timers: list[tuple[float, int, Callable]] = []  # link transfers in flight
        self.ids = itertools.count()
        self.arrived: set[tuple] = set()
        self.sent: list[list[tuple]] = [[] for _ in range(n)]
        self.link_free: dict[tuple, float] = {}
        self.now = 0.0
        self.timeline: list[tuple] = []
        self.busy = [0.0] * n

    def run(self) -> SharedStep:
        n = len(self.schedule)
        for s in range(n):
            self._advance(s)
        while self.jobs or self.timers:
            self._step_time()
            for s in range(n):
                self._advance(s)
        stuck = {s: str(self.schedule[s][self.pos[s]]) for s in range(n)
                 if self.pos[s] < len(self.schedule[s])}
        if stuck:
            raise PlanError(f"schedule deadlocks: every stage waits; next actions {stuck}")
        end = max((row[4] for row in self.timeline), default=0.0)
        return SharedStep(end, self.timeline, self.busy)

    # -- time ---------------------------------------------------------------------------

    def _step_time(self) -> None:
        """Advance to the next job end or arrival; run what it completes."""
        rate = min(1.0, self.sharing.cores / len(self.jobs)) if self.jobs else 0.0
        dt = min((r[0] for r in self.jobs.values()), default=float("inf"))
        dt = dt / rate if rate else float("inf")
        if self.timers:
            dt = min(dt, self.timers[0][0] - self.now)
        self.now += dt
        done = []
        for j, r in self.jobs.items():
            r[0] -= dt * rate
            if r[0] <= 1e-12:
                done.append(j)
        calls = [self.jobs.pop(j)[1] for j in done]
        while self.timers and self.timers[0][0] <= self.now + 1e-12:
            calls.append(heapq.heappop(self.timers)[2])
        for call in calls:
            call()

    def _job(self, seconds: float, on_done: Callable) -> int:
        j = next(self.ids)
        self.jobs[j] = [max(seconds, 0.0), on_done]
        return j

    # -- actions ------------------------------------------------------------------------

    def _cost(self, s: int, a):
        return self.costs[a.stage] if self.per_stage else self.costs[s]

    def _rank_sum(self, s: int, name: str) -> float:
        if not self.per_stage:
            return getattr(self.costs[s], name)
        return sum(getattr(self.costs[k], name) for k in self.chunks_of[s])

    def _advance(self, s: int) -> None:
        """Start list ``s``'s next actions while it is free and they can start."""
        acts = self.schedule[s]
        while self.running[s] is None and self.pos[s] < len(acts):
            a = acts[self.pos[s]]
            work = self._work(s, a)
            if work is None:
                return  # waits for a message
            self.started[s] = self.now
            if work == 0.0:
                self._finish(s)
                continue
            self.running[s] = self._job(work, lambda s=s: self._finish(s))

    def _work(self, s: int, a) -> float | None:
        """CPU seconds of action ``a`` on list ``s`` once it can start; None while it waits."""
        k, c = a.kind, self._cost(s, a)
        extra = c.action_s.get(k, 0.0)
        if k in COMPUTE:
            return self.sharing.inflation * self._compute_s(s, a, c) + extra + \
                self._copy_s(s, a, c)
        if k in _SENDS:
            return extra
        if k in _RECVS:
            key = self._key(a)
            if key not in self.arrived:
                return None
            return 0.0 if self.rank_of[key[1]] == s else extra
        if k == ActionKind.SYNC:
            if not all(key in self.arrived for key in self.sent[s]):
                return None
            return self._rank_sum(s, "sync_s") + extra
        if k == ActionKind.STEP:
            return self.sharing.inflation * self._rank_sum(s, "step_s") + extra
        return 0.0  # a migration's bookkeeping: no modelled time

    def _compute_s(self, s: int, a, c) -> float:
        """Profiled seconds of a compute action, as :mod:`~trainwright.plan.simulate`
        splits them (a split backward's ``B`` without ``W``; the first stage's ``W`` whole)."""
        w = c.weight_s or c.backward_s / 2
        if a.stage == 0:
            w = c.mb_backward_s.get(a.mb, c.backward_s)
        if a.kind == ActionKind.F:
            return c.mb_forward_s.get(a.mb, c.forward_s)
        if a.kind == ActionKind.W:
            return w
        return c.mb_backward_s.get(a.mb, c.backward_s) - (w if self.split[s] else 0.0)

    def _copy_s(self, s: int, a, c) -> float:
        """A host-swapped stage's copies, by the rank's own thread: out during ``F``, back
        during the backward (a split backward's ``B``; the first stage's ``W``, which runs
        its whole backward)."""
        whole_in_w = a.stage == 0 and self.split[s]
        copies = {ActionKind.F: True, ActionKind.B: not whole_in_w, ActionKind.W: whole_in_w}
        if not copies[a.kind]:
            return 0.0
        return self.sharing.copy_inflation * c.host_bytes / self.links.host_bandwidth

    def _key(self, a) -> tuple:
        v = a.stage
        if a.kind in _SENDS:
            kind, d = _SENDS[a.kind]
            return (kind, v, v + d, a.mb)
        kind, d = _RECVS[a.kind]
        return (kind, v + d, v, a.mb)

    def _finish(self, s: int) -> None:
        """List ``s``'s current action ends now."""
        a = self.schedule[s][self.pos[s]]
        if a.kind in COMPUTE:
            self.busy[s] += self.now - self.started[s]
        if a.kind in _SENDS:
            self._post(s, a)
        self.timeline.append((s, a.kind, a.mb, self.started[s], self.now))
        self.running[s] = None
        self.pos[s] += 1

    def _post(self, s: int, a) -> None:
        """A send's message: transport CPU here, the link, transport CPU at the receiver."""
        key = self._key(a)
        self.sent[s].append(key)
        dst = self.rank_of[key[2]]
        if dst == s:  # two chunks of one rank (ZB-V's turn): handed over in memory
            self.arrived.add(key)
            return
        c = self.costs[min(key[1], key[2])] if self.per_stage else self.costs[min(s, dst)]
        cpu = self.sharing.transport_s + self.sharing.transport_s_per_byte * c.send_bytes

        def on_link() -> None:
            self._job(cpu, lambda: self.arrived.add(key))

        def on_sent() -> None:
            link = (s, dst)
            start = max(self.now, self.link_free.get(link, 0.0))
            end = start + self.links.latency_s + c.send_bytes / self.links.bw(s, dst)
            self.link_free[link] = end
            heapq.heappush(self.timers, (end + self.links.delivery_s, next(self.ids), on_link))

        self._job(cpu, on_sent)
