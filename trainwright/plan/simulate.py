"""Replay a pipeline's action lists with costs: step time, bubbles, memory over time, deadlocks.

The simulator executes the very lists the runtime interprets
(:func:`~trainwright.schedule.actions.build_schedule`, with the peer-swap actions of
:func:`~trainwright.schedule.peer.with_peer_swap`), one action at a time, always
advancing the stage whose next action can start earliest (so shared links are reserved in
time order). Pure: no torch.

Semantics (matching :mod:`trainwright.pipeline.runtime` and gloo):

* ``F``/``B`` take the stage's compute time (``B`` includes recomputation);
* ``SEND_F``/``SEND_B`` post a transfer and go on. Point-to-point is a rendezvous (gloo
  and NCCL move the data once both sides are posted): the transfer occupies the directed
  link between the two stages' devices from ``max(send post, receive post, link free)``
  for ``latency + bytes / bandwidth`` (transfers on one link queue: contention);
* ``RECV_F``/``RECV_B`` wait for that transfer to arrive; a receive whose send was
  never posted, while no stage can move, is a **deadlock** (:class:`Deadlock`);
* ``SYNC`` waits for the stage's own sends to arrive and adds ``sync_s``; ``STEP`` adds
  ``step_s``;
* every action other than ``F``/``B`` then adds ``action_s[kind]`` (work beyond waiting);
* host swap: after ``F(m)`` the stage's host link carries ``host_bytes`` out; the copy back
  starts when the stage reaches ``B(m)``'s receive and ``B(m)`` waits for it;
* peer swap (:mod:`~trainwright.schedule.peer`): ``PEER_RECV`` posts a receive
  (the peer's memory grows by the chunk), ``PEER_SEND`` waits until the owner's chunks
  are delivered (posted by the pack hook during ``F(m)``, they move from
  ``max(F(m) start, receive post)``: a gloo send needs its receive posted first),
  ``PEER_RETURN`` waits for them and posts the send back (the data moves once the
  owner's ``PEER_FETCH`` has posted the receive), ``PEER_SETTLE`` waits for that
  delivery and frees the peer's copy, ``PEER_WAIT`` waits on the owner's side.

Several chunks per rank (interleaved 1F1B, ZB-V: one list per rank, actions naming model
stages): ``costs`` may hold one row per list, or one per **model stage**; then each
compute action and each transfer takes its own stage's row, ``SYNC`` / ``STEP`` the sum
of the rank's chunks', and a rank's memory and busy time add up its chunks'. A message
between two stages of one rank (ZB-V's turn) is handed over in memory: no link, no time.

Ranks sharing cores: with ``sharing`` (the calibration measured its terms) the step's times
come from the processor-sharing replay of :mod:`~trainwright.plan.sharing` (every CPU job,
compute, posting, the transport threads' work, shares the cores), its memory from this
replay. Otherwise, and for peer swap, which that replay does not model (``slowdown``,
:mod:`~trainwright.plan.calibration`): ``k`` ranks computing at once each run
``slowdown(k)`` times slower than alone. The replay is repeated with every rank's CPU work
scaled by ``f`` until ``f = slowdown(c)``, where ``c`` is the concurrency a computing rank
experiences in the replay (:func:`experienced_concurrency`; a fixed point, damped; a few
replays).

Memory per device (bytes the activation store counts, plus chunks held for peers):
``+held + peer_out`` at the end of ``F(m)``, ``-peer_out`` when ``PEER_SEND(m)`` ends,
``+peer_in`` at ``PEER_FETCH(m)``, ``+transient`` from the start of ``B(m)``, and all of
``m``'s bytes released at the end of ``B(m)``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from trainwright.errors import PlanError
from trainwright.plan import sharing as shared
from trainwright.plan.calibration import scaled
from trainwright.plan.sharing import Sharing
from trainwright.schedule.base import COMM, COMPUTE, PEER_KINDS, ActionKind

__all__ = ["StageCost", "Links", "SimResult", "Deadlock", "simulate", "liveness",
           "experienced_concurrency"]


class Deadlock(PlanError):
    """No stage can take its next action, and some have actions left."""


@dataclass
class StageCost:
    """Per-micro-batch costs of one stage."""

    forward_s: float
    backward_s: float
    """Backward compute, recomputation included."""
    weight_s: float = 0.0
    """Of ``backward_s``, the weight-gradient part: a zero-bubble schedule's ``W`` takes it
    and its ``B`` the rest (0: half of ``backward_s``)."""
    send_bytes: int = 0
    """Activation bytes sent to the next stage (the gradient coming back is as large)."""
    held_bytes: int = 0
    """Bytes held from the end of ``F(m)`` to the end of ``B(m)``."""
    transient_bytes: int = 0
    """Extra bytes during ``B(m)`` (host-swapped or recomputed activations, one layer)."""
    host_bytes: int = 0
    """Bytes swapped to host memory per micro-batch."""
    peer_bytes: dict = field(default_factory=dict)
    """Peer stage -> bytes of this stage's chunks it holds per micro-batch."""
    sync_s: float = 0.0
    step_s: float = 0.0
    action_s: dict = field(default_factory=dict)
    """Kind -> seconds of work an action takes once it can proceed, beyond what the model
    times (receive: header decode and payload copy after arrival; peer actions: posting
    every chunk's transfer). Calibrated from a trace; empty by default."""
    mb_forward_s: dict = field(default_factory=dict)
    """Micro-batch -> forward seconds, overriding ``forward_s`` (a replay of measured
    times, for checking the model apart from compute-time variance); optional."""
    mb_backward_s: dict = field(default_factory=dict)
    layer_forward_s: list = field(default_factory=list)
    """Per-layer forward times (for :func:`liveness`); optional."""
    layer_backward_s: list = field(default_factory=list)
    w_held_bytes: int = 0
    """Under a split backward: the bytes ``B(m)`` brings back (every host-swapped and
    recomputed layer's activations), held until ``W(m)``; 0: ``transient_bytes``."""


@dataclass
class Links:
    """Bandwidth between the devices the stages run on."""

    mapping: list[int]
    """Stage -> device."""
    bandwidth: list[list[float]]
    """Device x device bytes/s (0: no direct link; ``fallback`` is used)."""
    host_bandwidth: float = 12e9
    latency_s: float = 0.0
    fallback_bandwidth: float = 1e9
    delivery_s: float = 0.0
    """Extra seconds until a message between ranks is received, beyond ``latency_s`` and
    its bytes, that do not hold the link (ranks sharing the host's cores:
    :meth:`~trainwright.plan.calibration.Calibration.delivery`); not on host links."""

    def bw(self, a: int, b: int) -> float:
        """Bytes/s from stage ``a``'s device to stage ``b``'s."""
        x = self.bandwidth[self.mapping[a]][self.mapping[b]]
        return x if x > 0 else self.fallback_bandwidth


@dataclass
class SimResult:
    """What a replay found."""

    step_s: float
    busy_s: list[float]
    """Compute time per stage."""
    bubble: list[float]
    """Idle fraction per stage: ``1 - busy / step``."""
    peak_bytes: list[int]
    """Per stage (its device): activation bytes plus chunks held for peers, at most."""
    own_peak_bytes: list[int]
    """Per stage: the activation store's bytes only (what the runtime measures)."""
    timeline: list[tuple]
    """``(stage, kind, mb, start_s, end_s)`` of every action."""
    memory: list[list[tuple[float, int]]]
    """Per stage: ``(time, bytes)`` after each change."""
    times: dict = field(default_factory=dict)
    """``(stage, kind, mb) -> (start, end)`` of compute actions."""
    slowdown: float = 1.0
    """Shared-core factor the replay's CPU work was scaled by (1: none)."""

    def to_dict(self) -> dict:
        """Headline figures (JSON)."""
        return {"step_s": self.step_s, "busy_s": self.busy_s, "bubble": self.bubble,
                "peak_bytes": self.peak_bytes, "own_peak_bytes": self.own_peak_bytes,
                "slowdown": self.slowdown}


def _peak(events: list[tuple[float, int]]) -> tuple[int, list[tuple[float, int]]]:
    cur = peak = 0
    curve = []
    # at equal times releases go first: a transfer that ends when another starts frees first
    for t, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        peak = max(peak, cur)
        curve.append((t, cur))
    return peak, curve


def simulate(schedule: list[list], costs: list[StageCost], links: Links,
             slowdown: Callable[[float], float] | None = None,
             sharing: Sharing | None = None) -> SimResult:
    """Replay ``schedule`` (one action list per stage, one step) under ``costs``.

    Args:
        slowdown: concurrent computing ranks -> per-rank time factor (ranks sharing the
            host's cores, e.g. :meth:`~trainwright.plan.calibration.Calibration.factor`);
            None: every rank has a core of its own. The result's ``slowdown`` is the
            factor the replay settled on.
        sharing: the host's cores and CPU terms: the step's times come from the
            processor-sharing replay (:mod:`~trainwright.plan.sharing`), its memory from
            this one; ``slowdown`` is then used only where that replay does not model the
            schedule (peer swap). The result's ``slowdown`` is the step's ratio to the
            unshared replay.

    Raises:
        Deadlock: naming every stuck stage's next action and what it waits for.
    """
    n = len(schedule)
    n_virtual = len({a.stage for acts in schedule for a in acts if a.kind in COMPUTE})
    if len(costs) not in (n, n_virtual) or len(links.mapping) < n:
        raise PlanError(f"{n} stages need {n} stage costs (or one per model stage, "
                        f"{n_virtual}) and a device for each; got {len(costs)} costs and "
                        f"{len(links.mapping)} devices")
    replay = _Replay(schedule, costs, links)
    replay.run()
    res = replay.result()
    if sharing is not None and shared.supported(schedule):
        return _shared(res, shared.replay(schedule, costs, links, sharing))
    if slowdown is None:
        return res
    f = 1.0
    for i in range(_FIXED_POINT_ROUNDS):
        conc = experienced_concurrency(res.timeline)
        want = max(slowdown(max(conc, 1.0)), 1e-9)
        if abs(want - f) <= 1e-3 * f:
            break
        f = (f + want) / 2 if i else want  # damped after the first jump: c falls as f grows
        replay = _Replay(schedule, scaled(costs, f), links)
        replay.run()
        res = replay.result()
    res.slowdown = f
    return res


def _shared(res: SimResult, step: shared.SharedStep) -> SimResult:
    """``res`` (memory, order) with the times of the processor-sharing replay."""
    unshared = res.step_s
    res.step_s, res.busy_s, res.timeline = step.step_s, step.busy_s, step.timeline
    res.bubble = [1 - b / step.step_s if step.step_s else 0.0 for b in step.busy_s]
    res.slowdown = step.step_s / unshared if unshared else 1.0
    return res


_FIXED_POINT_ROUNDS = 12


def experienced_concurrency(timeline: list[tuple]) -> float:
    """How many ranks compute at once, as a computing rank sees it: the mean over compute
    time of the number of ranks computing then (``sum k^2 dt / sum k dt`` over the
    stretches where ``k`` ranks compute; 1.0 without compute).

    The time average (``sum(busy) / step``) is lower wherever a pipeline alternates
    between all ranks busy and few busy: a GPipe of 4 stages with 4 micro-batches on 2
    cores averages 1.4 ranks at once, yet its ranks computed 1.28x slower than their
    profile, as 3 or 4 do at once on 2 cores (measured on the 2-core host).

    Args:
        timeline: :attr:`SimResult.timeline` rows ``(stage, kind, mb, start, end)``; the
            compute kinds count, per rank (a rank's chunks never overlap in time).
    """
    edges = []
    for _, kind, _, start, end in timeline:
        if kind in COMPUTE and end > start:
            edges += [(start, 1), (end, -1)]
    edges.sort()
    k, last, num, den = 0, 0.0, 0.0, 0.0
    for t, d in edges:
        if k:
            num += k * k * (t - last)
            den += k * (t - last)
        k, last = k + d, t
    return num / den if den else 1.0
"""Replays at most, to settle the shared-core factor (converges in a few)."""


class _Replay:
    """The state of one :func:`simulate` call: clocks, posted messages, links, memory."""

    def __init__(self, schedule: list[list], costs: list[StageCost], links: Links) -> None:
        n = len(schedule)
        self.schedule, self.costs, self.links, self.n = schedule, costs, links, n
        # several chunks per rank: one cost per model stage (else one per list, as before)
        self.per_stage = len(costs) != n
        self.chunks_of = [sorted({a.stage for a in acts if a.kind in COMPUTE})
                          for acts in schedule]
        self.split = [any(a.kind == ActionKind.W for a in acts) for acts in schedule]
        self.clock = [0.0] * n
        self.pos = [0] * n
        self.link_free: dict[tuple, float] = {}
        self.arrived: dict[tuple, float] = {}  # message key -> arrival time
        self.posted_recv: dict[tuple, float] = {}  # peer-swap receive key -> post time
        self.sent: dict[tuple, float] = {}  # pipeline message key -> send post time
        self.returned: dict[tuple, float] = {}  # (peer, owner, mb) -> PEER_RETURN post time
        self.pending_sends: list[list[tuple]] = [[] for _ in range(n)]  # message keys
        self.host_back: dict[tuple[int, int], float] = {}  # (stage, mb) -> copy-back arrival
        self.busy = [0.0] * n
        self.mem: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self.own: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self.timeline: list[tuple] = []
        self.times: dict = {}
        # a stage's next action can only become ready when the stage moves or a message for
        # it is posted, so keep each stage's earliest start in a heap and refresh those two
        self.heap: list[tuple[float, int, int]] = []
        self.version = [0] * n
        # interleaved schedules: a list per rank, actions name virtual stages (else s == stage)
        self.rank_of = {a.stage: s for s, acts in enumerate(schedule) for a in acts}

    def run(self) -> None:
        """Take actions, earliest start first, until no stage can move."""
        for s in range(self.n):
            self._refresh(s)
        while self.heap:
            start, s, v = heapq.heappop(self.heap)
            if v != self.version[s]:
                continue
            a = self.schedule[s][self.pos[s]]
            end = self._run(s, a, start)
            self.timeline.append((s, a.kind, a.mb, start, end))
            self.clock[s] = end
            self.pos[s] += 1
            self._refresh(s)
            step = _NEIGHBOUR.get(a.kind)
            other = getattr(a, "peer", -1) if step is None else \
                self.rank_of.get(a.stage + step, -1)
            if 0 <= other < self.n and other != s:
                self._refresh(other)

    def result(self) -> SimResult:
        """The replay's figures; raises :class:`Deadlock` if some stage has actions left."""
        n, schedule, pos = self.n, self.schedule, self.pos
        if any(pos[s] < len(schedule[s]) for s in range(n)):
            stuck = {s: str(schedule[s][pos[s]]) for s in range(n) if pos[s] < len(schedule[s])}
            raise Deadlock(f"schedule deadlocks: every stage waits; next actions {stuck}")
        step = max(self.clock) if self.clock else 0.0
        peaks, own_peaks, curves = [], [], []
        for s in range(n):
            p, curve = _peak(self.mem[s])
            peaks.append(p)
            curves.append(curve)
            own_peaks.append(_peak(self.own[s])[0])
        busy = self.busy
        return SimResult(step, busy, [1 - b / step if step else 0.0 for b in busy], peaks,
                         own_peaks, self.timeline, curves, self.times)

    def _refresh(self, s: int) -> None:
        """Push stage ``s``'s next action with its earliest start, if it can start."""
        self.version[s] += 1
        if self.pos[s] < len(self.schedule[s]):
            t = self._ready(s, self.schedule[s][self.pos[s]])
            if t is not None:
                heapq.heappush(self.heap, (t, s, self.version[s]))

    def _transfer(self, key_link: tuple, t0: float, nbytes: int, bw: float) -> float:
        """Reserve link ``key_link`` from ``t0`` (or when it frees); return the arrival
        (``delivery_s`` later on a link between ranks, without holding the link)."""
        start = max(t0, self.link_free.get(key_link, 0.0))
        end = start + self.links.latency_s + nbytes / bw
        self.link_free[key_link] = end
        return end if key_link[0] == "host" else end + self.links.delivery_s

    def _back(self, peer: int, owner: int, mb: int) -> None:
        """Start a return transfer once both its send and its receive are posted."""
        sent = self.returned.get((peer, owner, mb))
        post = self.posted_recv.get(("back", owner, peer, mb))
        if sent is not None and post is not None:
            self.arrived[("back", peer, owner, mb)] = self._transfer(
                (peer, owner), max(sent, post), self.costs[owner].peer_bytes.get(peer, 0),
                self.links.bw(peer, owner))

    def _add(self, s: int, t: float, d: int, store: bool = True) -> None:
        """Record a change of ``d`` bytes on stage ``s`` at ``t`` (``store``: own bytes too)."""
        self.mem[s].append((t, d))
        if store:
            self.own[s].append((t, d))

    def _cost(self, s: int, a) -> StageCost:
        """The cost row of action ``a`` on list ``s``: its model stage's, or the list's."""
        return self.costs[a.stage] if self.per_stage else self.costs[s]

    def _rank_sum(self, s: int, field_name: str) -> float:
        """``sync_s`` / ``step_s`` of list ``s``: summed over its chunks' rows, per stage."""
        if not self.per_stage:
            return getattr(self.costs[s], field_name)
        return sum(getattr(self.costs[k], field_name) for k in self.chunks_of[s])

    def _ready(self, s: int, a) -> float | None:
        """Earliest start of action ``a`` on stage ``s``, or None while it must wait."""
        k, mb, now = a.kind, a.mb, self.clock[s]
        if k in (ActionKind.RECV_F, ActionKind.RECV_B):
            v = a.stage  # posted once the send is: the data moves then
            got = self.sent.get(("act", v - 1, v, mb) if k == ActionKind.RECV_F
                                else ("grad", v + 1, v, mb))
            return None if got is None else now
        if k == ActionKind.SYNC:
            done = [self.arrived.get(key) for key in self.pending_sends[s]]
            return None if None in done else max([now, *done])
        if k in _PEER_WAITS:
            return self._peer_ready(s, a, now)
        if k == ActionKind.B and self._cost(s, a).host_bytes:
            back = self.host_back.get((a.stage, mb))
            if back is None:  # the copy back starts now (no receive before this B)
                back = self._transfer(("host", s),
                                      max(now, self.link_free.get(("host", s), 0.0)),
                                      self._cost(s, a).host_bytes, self.links.host_bandwidth)
                self.host_back[(a.stage, mb)] = back
            return max(now, back)
        return now

    def _peer_ready(self, s: int, a, now: float) -> float | None:
        """:meth:`_ready` of a peer-swap action that waits for a post or a delivery."""
        k, mb = a.kind, a.mb
        if k == ActionKind.PEER_SEND:
            post = self.posted_recv.get(("out", s, a.peer, mb))
            return None if post is None else now
        if k == ActionKind.PEER_RETURN:
            got = self.arrived.get(("chunk", a.peer, s, mb))
        elif k == ActionKind.PEER_SETTLE:
            got = self.arrived.get(("back", s, a.peer, mb))
        else:  # PEER_WAIT
            got = self.arrived.get(("back", a.peer, s, mb))
        return None if got is None else max(now, got)

    def _run(self, s: int, a, start: float) -> float:
        """Take action ``a`` on stage ``s`` from ``start``; return its end."""
        k = a.kind
        rank_wide = k in (ActionKind.SYNC, ActionKind.STEP)
        c = self.costs[self.chunks_of[s][0]] if rank_wide and self.per_stage \
            else self._cost(s, a)
        end = _RUN.get(k, _Replay._run_free)(self, s, a, start)
        return end + c.action_s.get(k, 0.0)

    def _run_sync(self, s: int, a, start: float) -> float:
        return start + self._rank_sum(s, "sync_s")

    def _run_step(self, s: int, a, start: float) -> float:
        return start + self._rank_sum(s, "step_s")

    def _run_free(self, s: int, a, start: float) -> float:
        """Any other kind (a migration's) takes no time."""
        return start

    def _run_compute(self, s: int, a, start: float) -> float:
        """``F``/``B``/``W``: compute time, memory, and the host swap's copy out after ``F``.

        With ``W`` actions (zero bubble) ``B`` takes ``backward_s - weight_s`` (nothing on
        the first stage, whose ``W`` runs the whole backward) and the micro-batch's bytes
        stay held until its ``W`` ends."""
        mb, c = a.mb, self._cost(s, a)
        # a split backward keeps what B brought back (every layer's) until W
        extra = (c.w_held_bytes or c.transient_bytes) if self.split[s] else c.transient_bytes
        held = c.held_bytes + extra + sum(c.peer_bytes.values())
        w = c.weight_s or c.backward_s / 2
        if a.stage == 0:  # the first stage's B defers all its work to W (Stage.backward)
            w = c.mb_backward_s.get(mb, c.backward_s)
        if a.kind == ActionKind.F:
            dur = c.mb_forward_s.get(mb, c.forward_s)
            end = start + dur
            self._add(s, end, c.held_bytes + sum(c.peer_bytes.values()))
            if c.host_bytes:
                self._transfer(("host", s), end, c.host_bytes, self.links.host_bandwidth)
        elif a.kind == ActionKind.W:
            dur = w
            end = start + dur
            if (a.stage, ActionKind.F, mb) not in self.times:  # carried from the last step:
                self._add(s, 0.0, held)  # held from this one's start (schedule.carry)
            self._add(s, end, -held)
        else:
            dur = c.mb_backward_s.get(mb, c.backward_s) - (w if self.split[s] else 0.0)
            end = start + dur
            self._add(s, start, extra)
            if not self.split[s]:
                self._add(s, end, -held)
        self.busy[s] += dur
        self.times[(a.stage, a.kind, mb)] = (start, end)
        return end

    def _run_p2p(self, s: int, a, start: float) -> float:
        """Pipeline sends (post and go on) and receives (the rendezvous transfer)."""
        k, mb, c, v = a.kind, a.mb, self._cost(s, a), a.stage
        if k in (ActionKind.SEND_F, ActionKind.SEND_B):
            key = ("act", v, v + 1, mb) if k == ActionKind.SEND_F else ("grad", v, v - 1, mb)
            self.sent[key] = start
            self.pending_sends[s].append(key)
            return start
        key = ("act", v - 1, v, mb) if k == ActionKind.RECV_F else ("grad", v + 1, v, mb)
        src = self.rank_of[key[1]]
        sender = self.costs[min(key[1], key[2])] if self.per_stage else self.costs[min(src, s)]
        if src == s:  # two chunks of one rank (ZB-V's turn): handed over in memory
            end = self.arrived[key] = max(start, self.sent[key])
        else:
            end = self.arrived[key] = self._transfer(
                (src, s), max(start, self.sent[key]), sender.send_bytes, self.links.bw(src, s))
        if k == ActionKind.RECV_B and c.host_bytes:
            self.host_back[(v, mb)] = self._transfer(("host", s), start, c.host_bytes,
                                                     self.links.host_bandwidth)
        return end

    def _run_peer(self, s: int, a, start: float) -> float:
        """Peer-swap actions."""
        k, mb, c = a.kind, a.mb, self.costs[s]
        end = start
        if k == ActionKind.PEER_RECV:  # peer s posts the receive of owner a.peer's chunks
            self.posted_recv[("out", a.peer, s, mb)] = start
            self._add(s, start, self.costs[a.peer].peer_bytes.get(s, 0), store=False)
        elif k == ActionKind.PEER_SEND:
            nbytes = c.peer_bytes.get(a.peer, 0)
            # the pack hook posted the chunks as F(m) saved them: they move during F(m)
            posted = self.times.get((s, ActionKind.F, mb), (start,))[0]
            got = self._transfer((s, a.peer),
                                 max(posted, self.posted_recv[("out", s, a.peer, mb)]),
                                 nbytes, self.links.bw(s, a.peer))
            self.arrived[("chunk", s, a.peer, mb)] = got
            end = max(start, got)
            self._add(s, end, -nbytes)
        elif k == ActionKind.PEER_RETURN:  # the data moves once the owner's receive is posted too
            self.returned[(s, a.peer, mb)] = start
            self._back(s, a.peer, mb)
        elif k == ActionKind.PEER_SETTLE:
            self._add(s, start, -self.costs[a.peer].peer_bytes.get(s, 0), store=False)
        elif k == ActionKind.PEER_FETCH:
            self.posted_recv[("back", s, a.peer, mb)] = start
            self._back(a.peer, s, mb)
            self._add(s, start, c.peer_bytes.get(a.peer, 0))
        return end


_NEIGHBOUR = {ActionKind.SEND_F: 1, ActionKind.SEND_B: -1, ActionKind.RECV_F: -1,
              ActionKind.RECV_B: 1}
"""Transfer kind -> the other end's stage, relative to the action's."""

_PEER_WAITS = frozenset({ActionKind.PEER_SEND, ActionKind.PEER_RETURN, ActionKind.PEER_SETTLE,
                         ActionKind.PEER_WAIT})
"""Peer-swap kinds that wait for a post or a delivery (:meth:`_Replay._peer_ready`)."""

_RUN = {**dict.fromkeys(COMPUTE, _Replay._run_compute), **dict.fromkeys(COMM, _Replay._run_p2p),
        ActionKind.SYNC: _Replay._run_sync, ActionKind.STEP: _Replay._run_step,
        **dict.fromkeys(PEER_KINDS, _Replay._run_peer)}
"""The replay's dispatch: kind -> how :class:`_Replay` takes it (other kinds: no time)."""


def liveness(result: SimResult, costs: list[StageCost],
             layers: list[list[int]]) -> dict[int, float]:
    """Each layer's shortest live interval over the micro-batches of a replay.

    A tensor of layer ``l`` (the ``i``-th of its stage) is packed when the layer's forward
    ends, ``F_start + sum(forward of layers 0..i)``, and unpacked when its backward starts,
    ``B_start + sum(backward of layers after i)``.

    Args:
        result: a replay (all-keep, usually).
        costs: the stage costs it used, with ``layer_forward_s``/``layer_backward_s``.
        layers: the layer indices of each stage, in order.

    Returns:
        Layer -> seconds.
    """
    out: dict[int, float] = {}
    forwards: dict[int, list[tuple[int, float]]] = {}
    for (st, kind, mb), (f0, _) in result.times.items():
        if kind == ActionKind.F:
            forwards.setdefault(st, []).append((mb, f0))
    for s, names in enumerate(layers):
        c = costs[s]
        fw = c.layer_forward_s or [c.forward_s / max(len(names), 1)] * len(names)
        bw = c.layer_backward_s or [c.backward_s / max(len(names), 1)] * len(names)
        packed_at = list(itertools.accumulate(fw))
        after = list(itertools.accumulate(reversed(bw)))[::-1][1:] + [0.0]
        for mb, f0 in forwards.get(s, []):
            b0 = result.times[(s, ActionKind.B, mb)][0]
            for i, layer in enumerate(names):
                span = max(0.0, b0 + after[i] - f0 - packed_at[i])
                out[layer] = min(out.get(layer, span), span)
    return out
