"""Token-ring gradient exchange: the token and its running sum, step closing, the closed
sum's pass, receiver thread.

A token circulates over the ring members and carries the open step's **running sum**: a
holder whose gradient for the token's step is ready adds it to the sum (``sum + g``, in the
token's order) and appends itself to the token's contributions; a holder not ready passes
the token on, or keeps it (with its sum) while nobody else is ready. Every node announces
when its gradient is ready (``want``, a few bytes), and a holder hands the token straight
to a ready node, so the sum only travels to nodes that add to it. When every member has
contributed, the holder closes the step at once; when the contributions cover
``close_fraction`` of the members, it closes it once the adaptive grace
(:mod:`~trainwright.tokenring.grace`) has passed with no ready node still missing.
The closer then sends the closed sum around the ring in pipelined chunks (both ways
round for a sum of few chunks, :mod:`~trainwright.tokenring.sumpass`): each member
forwards each chunk at most once. A node thus
sends about two gradients per step (the sum once with the token, once in the pass), not
``n - 1`` copies of its own as the original design's broadcast did.

``close(step, contributors)`` travels inside the later token messages (a window of recent
closes), so a node that misses one message still learns every close. Every node applies the
same closed sum, ``w <- w - lr * sum / n``: replicas stay bit-identical. A background
thread (:class:`TokenRing`) does all of this while the trainer computes; the trainer only
offers gradients and waits for closes.

Transport (no silent loss): :class:`~trainwright.tokenring.links.Links` (one queued link per
peer, per-link sequence numbers, so a gap is detected and counted). A closed sum that has
not arrived is fetched from any member that has it; if nobody has it (its closer died
before its pass), it is rebuilt from the contributions, which every contributor keeps, in
the close's order (:func:`~trainwright.tokenring.sumpass.fold`: bit for bit the token's sum).
A running sum lost with a dead holder is dropped and its contributors add again when the
token reaches them: their offers stand until the step closes. Every hop also sends the
other members a notice of the token (:func:`~trainwright.tokenring.token.token_header`),
so everyone knows the holder and when the ring went quiet; the notice stays small as the
ring grows (the last closes only, the membership only while an epoch is new), so a node's
bytes per step stay about two gradients at any ring size (:mod:`~trainwright.tokenring.scale`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from trainwright.errors import CommError
from trainwright.tokenring.grace import AdaptiveGrace
from trainwright.tokenring.links import Links
from trainwright.tokenring.membership import Epoch, Rendezvous, announce_delay, ring_distance
from trainwright.tokenring.sumpass import (
    CHUNK_BYTES,
    SumAssembly,
    SumBuffers,
    chunk_plan,
    chunk_tensors,
    fold,
    layout_of,
    pass_routes,
)
from trainwright.tokenring.token import (
    CLOSE_WINDOW,
    RingFailed,
    RingLeft,
    RingTimes,
    Token,
    contributors_needed,
    sum_canonical,
    token_header,
)
from trainwright.tokenring.wire import unpack

__all__ = ["RingTimes", "TokenRing", "Token", "contributors_needed", "sum_canonical",
           "RingLeft", "RingFailed", "CLOSE_WINDOW"]

log = logging.getLogger(__name__)
RETAIN_STEPS = 64
"""Closed steps whose gradients a node keeps to answer fetches (late joiners, lost frames)."""


@dataclass
class _Stats:
    contributed: list[int] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    gaps: int = 0
    fetches: int = 0
    retransmissions: int = 0
    bytes_received: int = 0
    rebuilt: int = 0
    """Closed sums rebuilt from the contributions (their closer died before its pass)."""
    dropped_sums: int = 0
    """Running sums lost with a dead holder (their contributors added again)."""


class TokenRing:
    """One node's side of the ring: a receiver thread plus the calls the trainer makes.

    Args:
        ctx: ZeroMQ context.
        index: this node's index (its data shard, its place in the ring).
        pull: this node's bound PULL socket (owned by the thread from now on).
        epoch: the membership to start in.
        close_fraction: share of the members' samples that closes a step.
        min_nodes: below this many members the ring fails.
        total_steps: the last step; the token stops after it closes.
        times: protocol time-outs.
        rendezvous: the formation host, on the node that hosts it (admits standby nodes).
        token: the token to start from (a newly formed ring's first node creates one).
        closes: closes known already (a node admitted later gets them in its welcome).
        applied: last step whose update this node's weights include.
        early: messages received before the thread started (replayed first).
        clock: monotonic seconds, the time base of every protocol timer (silence, grace,
            idle hold, the gradients' deadline); tests pass a fake one.
    """

    def __init__(self, ctx: zmq.Context, index: int, pull: zmq.Socket, epoch: Epoch, *,
                 close_fraction: float, min_nodes: int, total_steps: int, times: RingTimes,
                 rendezvous: Rendezvous | None = None, token: Token | None = None,
                 closes: dict[int, list[int]] | None = None, applied: int = 0,
                 early: list | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.ctx, self.index, self.pull, self.epoch = ctx, index, pull, epoch
        self.close_fraction, self.min_nodes, self.total = close_fraction, min_nodes, total_steps
        self.times, self.rdzv = times, rendezvous
        self.links = Links(ctx, index)
        self.cv = threading.Condition()
        self.closes: dict[int, list[int]] = dict(closes or {})
        self.grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.tok = token
        self.applied = applied
        self.status, self.reason = "running", ""
        self.stats = _Stats()
        self._offer: tuple[int, list[torch.Tensor]] | None = None
        self._acted_hop: tuple | None = None
        self._hold_since = 0.0
        self._last_heard = self.clock()
        self._last_tok: dict | None = None
        """The last token message this node sent or received (sent on once after silence)."""
        self._retx_done = False
        self._admit: tuple[list[torch.Tensor], int] | None = None
        self._fetch: list[tuple[int, int]] = []
        self._done: set[int] = set()
        self._wanted_sent = 0
        self._late_want: int | None = None
        """A closed step this node's gradient became ready for (:meth:`late`), to announce."""
        self._finishing = self._done_sent = False
        self.close_time: dict[int, float] = {}
        self._quorum_at: dict[int, float] = {}
        """Per step: when this node first saw its contributions reach the fraction rule."""
        self.grace = AdaptiveGrace(times.close_grace_s)
        self.sums: dict[int, list[torch.Tensor]] = {}
        """Closed steps' sums (received in the pass, or closed here)."""
        self._asm: dict[int, SumAssembly] = {}
        self._buffers = SumBuffers()
        """Tensors of sums assembled here and since dropped, for the next assemblies."""
        self._assembled: set[int] = set()
        """Steps whose sum in :attr:`sums` was assembled here (its tensors are this node's
        alone: they go back to :attr:`_buffers` when the sum is dropped)."""
        self._acc: tuple[int, tuple[int, ...], list[torch.Tensor]] | None = None
        """The running sum this node holds: (step, contributors in order, tensors)."""
        self._fetch_sum: list[int] = []
        self.grad_bytes = 0
        """Bytes of one gradient (this node's offers)."""
        self._heard: dict[int, float] = {}
        """When this node last heard from each node (any message)."""
        self._pred: tuple[tuple[int, int], float] | None = None
        """(epoch key, when this node started watching its predecessor in it)."""
        self._alive_sent = float("-inf")
        """Readiness times per step and the grace they imply (:mod:`.grace`)."""
        self._early = list(early or [])
        self._ever = dict(epoch.members)
        """Every node of every epoch seen here, and its address."""
        self._stop = threading.Event()
        self._wake_rx, self._wake = socket.socketpair()  # an offer wakes the thread's poll
        self._wake_rx.setblocking(False)
        self._wake.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"tokenring-{index}", daemon=True)

    # ---------------------------------------------------------------- trainer side
    def start(self) -> None:
        """Start the receiver thread."""
        self._thread.start()

    def offer(self, step: int, grads: list[torch.Tensor]) -> None:
        """Make this node's gradient of ``step`` available; it is sent when the token comes."""
        with self.cv:
            self._offer = (step, grads)
            self.grad_bytes = sum(g.nelement() * g.element_size() for g in grads)
            self.grace.ready(step, self.index, self.clock())
        self._wake_poll()  # announce it now, not at the next poll

    def late(self, step: int) -> None:
        """This node's gradient of ``step`` is ready but the step closed before it was: tell
        the ring when (a ``want`` after the close), so the grace knows how far behind this
        node runs (:meth:`~trainwright.tokenring.grace.AdaptiveGrace.known_late`)."""
        with self.cv:
            self.grace.ready(step, self.index, self.clock())
            self._late_want = step
        self._wake_poll()

    def closed(self, step: int) -> bool:
        """Whether ``step`` has closed."""
        with self.cv:
            return step in self.closes

    def wait_closed(self, step: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``step`` to close; False if it did not (no error)."""
        with self.cv:
            return self.cv.wait_for(lambda: step in self.closes or self.status != "running",
                                    timeout_s) and step in self.closes

    def wait_close(self, step: int) -> None:
        """Wait until ``step`` closes.

        Raises:
            RingLeft / RingFailed: the node was dropped, or the ring failed.
            CommError: no close within ``close_timeout_s``.
        """
        with self.cv:
            ok = self.cv.wait_for(lambda: step in self.closes or self.status != "running",
                                  self.times.close_timeout_s)
            self._raise_status()
            if not ok:
                raise CommError(f"token ring node {self.index}: step {step} did not close within "
                                f"{self.times.close_timeout_s:.0f} s (members "
                                f"{self.epoch.order}); raise tokenring.close_timeout_s if "
                                f"steps are that slow")

    def _raise_status(self) -> None:
        if self.status == "left":
            raise RingLeft(self.reason)
        if self.status == "failed":
            raise RingFailed(self.reason)

    def closed_through(self) -> int:
        """The highest step ``s`` such that every step up to ``s`` has closed."""
        with self.cv:
            s = self.applied
            while s + 1 in self.closes:
                s += 1
            return s

    def close_of(self, step: int) -> list[int]:
        """The contributors of closed ``step``."""
        with self.cv:
            return list(self.closes[step])

    def summed(self, step: int, contributors: list[int]) -> list[torch.Tensor]:
        """Wait for the closed sum of ``step`` (fetching it, or rebuilding it from the
        ``contributors``' gradients, if its pass does not bring it).

        Raises:
            RingFailed: neither arrived after ``close_timeout_s`` and a contributor whose
                gradient is missing has left the ring: the sum was lost with it (it died
                before passing the sum on), so no member can apply ``step``.
            CommError: neither arrived after ``close_timeout_s`` (the contributors are
                still members).
        """
        end = self.clock() + self.times.close_timeout_s
        with self.cv:
            while True:
                if step in self.sums:
                    return self.sums[step]
                if all((step, c) in self.grads for c in contributors):
                    self.sums[step] = fold([self.grads[(step, c)] for c in contributors])
                    self.stats.rebuilt += 1
                    return self.sums[step]
                self._raise_status()
                left = end - self.clock()
                if left <= 0:
                    missing = [c for c in contributors if (step, c) not in self.grads]
                    gone = [c for c in missing if c not in self.epoch.members]
                    if gone:
                        raise RingFailed(
                            f"token ring node {self.index}: the sum of step {step} (closed "
                            f"with {contributors}) was lost with node(s) {gone}, which left "
                            f"the ring before passing it on; without their gradients no "
                            f"member can rebuild it")
                    raise CommError(f"token ring node {self.index}: the sum of step {step} "
                                    f"(closed with {contributors}) never arrived, and no member "
                                    f"resent the gradients of node(s) {missing} to rebuild it")
                if not self.cv.wait(min(left, self.times.fetch_after_s)):
                    self._fetch_sum.append(step)
                    self._fetch.extend((step, c) for c in contributors
                                       if (step, c) not in self.grads)
                    self.stats.fetches += 1

    def note_applied(self, step: int, weights: list[torch.Tensor] | None = None,
                     admit_every: int = 0, extra: dict | None = None) -> None:
        """The trainer applied ``step``. On the first node at a batch boundary
        (``step % admit_every == 0``) standby nodes are admitted with ``weights`` (and
        ``extra`` in their welcome header: where the optimizer state is among them)."""
        with self.cv:
            self.applied = step
            for key in [k for k in self.grads if k[0] <= step - RETAIN_STEPS]:
                del self.grads[key]
            for old in [k for k in self.sums if k <= step - RETAIN_STEPS]:
                tensors = self.sums.pop(old)
                if old in self._assembled:
                    self._assembled.discard(old)
                    self._buffers.give(tensors)
            for old in [k for k in self._asm if k <= step]:
                self._buffers.give(self._asm.pop(old).tensors)
            if (weights is not None and admit_every and step % admit_every == 0
                    and step < self.total and self.rdzv is not None
                    and self.epoch.first() == self.index and self.rdzv.standby):
                self._admit = ([w.detach().clone() for w in weights], step, extra)

    def wants_weights(self, step: int, admit_every: int) -> bool:
        """Whether :meth:`note_applied` for ``step`` should get a weight snapshot."""
        return (admit_every > 0 and step % admit_every == 0 and self.rdzv is not None
                and bool(self.rdzv.standby))

    def finish(self, linger_s: float) -> None:
        """Tell the members this node is done; serve fetches until all are (or ``linger_s``)."""
        with self.cv:
            self._finishing = True
            self.cv.wait_for(lambda: set(self.epoch.members) - {self.index} <= self._done
                             or self.status != "running", linger_s)

    def stop(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.links.close()
        self.pull.close(0)
        self._wake_rx.close()
        self._wake.close()

    def _wake_poll(self) -> None:
        """End the receiver thread's current poll (a byte on its wake-up socket)."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake.send(b"\0")

    def send_welcome(self, idx: int, addr: str, applied: int, weights: list[torch.Tensor],
                     extra: dict | None = None) -> None:
        """Send ``idx`` the membership, the closes after ``applied`` and the weights (before
        :meth:`start`, or from the thread); ``extra`` goes into the header."""
        closes = {str(s): c for s, c in self.closes.items() if s > applied}
        self._send(idx, addr, {**(extra or {}), "t": "welcome", "ep": self.epoch.to_json(),
                               "applied": applied, "closes": closes}, weights)

    def expect_from(self, src: int, inc: int, seq: int) -> None:
        """Continue the sequence check of ``(src, inc)`` after a message read outside."""
        self.links.expect_from(src, inc, seq)

    # ---------------------------------------------------------------- sending
    def _send(self, idx: int, addr: str, header: dict, tensors: list[torch.Tensor] = ()) -> None:
        self.links.send(idx, addr, header, tensors)

    def _broadcast(self, header: dict, tensors: list[torch.Tensor] = ()) -> None:
        self.links.broadcast(self.epoch.members, header, tensors)

    def _send_token(self) -> None:
        """The whole token and the running sum to the next holder; the token's notice to
        every other member."""
        t, acc = self.tok, self._acc
        whole = token_header(t, self.epoch, self.closes, to_holder=True)
        notice = token_header(t, self.epoch, self.closes, to_holder=False)
        carry = (acc[2] if t.contribs and acc is not None
                 and acc[:2] == (t.step, tuple(t.contribs)) else [])
        for i, addr in self.epoch.members.items():
            if i == t.holder and i != self.index:
                self._send(i, addr, whole, carry)
            elif i != self.index:
                self._send(i, addr, notice)
        self._last_tok = notice
        self._retx_done = False
        self._last_heard = self.clock()

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self._wake_rx.fileno(), zmq.POLLIN)  # ready as its descriptor
        if self.rdzv is not None:
            poller.register(self.rdzv.sock, zmq.POLLIN)
        for frames in self._early:
            self._handle(frames)
        self._early = []
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(2))
                if self._wake_rx.fileno() in ready:
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_rx.recv(4096):
                            pass
                if self.pull in ready:
                    for _ in range(64):
                        try:
                            frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                with self.cv:
                    if self.rdzv is not None:
                        self.rdzv.handle()
                    self._serve()
        except Exception as exc:  # a protocol bug must not hang the trainer
            log.exception("token ring node %d: receiver thread failed", self.index)
            with self.cv:
                self.status, self.reason = "failed", f"receiver thread failed: {exc!r}"
                self.cv.notify_all()

    def _serve(self) -> None:
        """Periodic work under the lock: fetches, done notices, holding, time-outs."""
        if self._fetch_sum:
            wanted, self._fetch_sum = self._fetch_sum, []
            for step in set(wanted):
                self._broadcast({"t": "fetch", "step": step, "node": -1})
        if self._fetch:
            wanted, self._fetch = self._fetch, []
            for step, c in set(wanted):
                self._broadcast({"t": "fetch", "step": step, "node": c})
        if self._finishing and not self._done_sent:
            self._done_sent = True
            self._broadcast({"t": "done"})
        if self.status != "running":
            return
        offer, t = self._offer, self.tok
        # the step the ring is on: the token's, or, before this node has heard the token
        # (a new member until the first hop), the one after the last applied: waiting for
        # the token to say so, every member's first step waited for the holder's idle
        # limit (a quarter of token_timeout_s, 0.3 s of the benchmark's 0.5 s first step)
        current = t.step if t is not None else self.applied + 1
        if offer is not None and offer[0] > self._wanted_sent and offer[0] == current:
            # tell the ring a gradient is ready: holders stop keeping an idle token, nobody
            # closes the step without it, and every member measures the arrival spread
            self._wanted_sent = offer[0]
            self._broadcast({"t": "want", "step": offer[0]})
        if self._late_want is not None:
            self._broadcast({"t": "want", "step": self._late_want})
            self._late_want = None
        if t is not None and t.holder == self.index:
            self._act()
        self._check_silence()

    def _handle(self, frames: list) -> None:
        header, tensors = unpack(frames)
        src, kind = header["src"], header["t"]
        self.stats.bytes_received += sum(len(f) for f in frames)
        self._heard[src] = self.clock()
        lost = self.links.check(header)
        if lost:
            self.stats.gaps += 1
            log.warning("token ring node %d: %d message(s) from node %d lost in transit",
                        self.index, lost, src)
        with self.cv:
            seen = self._waited_on()
            if kind == "grad":
                self._on_grad(header, tensors)
            elif kind == "sum":
                self._on_chunk(header, tensors)
            elif kind == "tok":
                self._on_tok(header, tensors)
            elif kind == "fetch" and header["node"] < 0:
                have = self.sums.get(header["step"])
                addr = self.epoch.members.get(src)
                if have is not None and addr is not None:
                    # a copy: the answer may wait in a queue after the sum's tensors went
                    # back to the buffers for a later step's sum
                    self._pass_sum(header["step"], [t.clone() for t in have], [(src, 0, src)],
                                   origin=-1)
            elif kind == "fetch":
                have = self.grads.get((header["step"], header["node"]))
                addr = self.epoch.members.get(src)
                if have is not None and addr is not None:
                    self._send(src, addr, {"t": "grad", "step": header["step"],
                                           "node": header["node"]}, have)
            elif kind == "want":
                self.grace.ready(header["step"], src, self.clock())
            elif kind == "done":
                self._done.add(src)
            elif kind == "fail":
                if tuple(header["ep"]["key"]) >= self.epoch.key:
                    self._set_status("failed", header["reason"])
            elif kind == "left":
                ep = Epoch.from_json(header["ep"])
                if ep.key > self.epoch.key and self.index not in ep.members:
                    self._set_status("left", f"node {src} says epoch {ep.key} has members "
                                     f"{ep.order} without this node")
            if self._waited_on() != seen:
                self.cv.notify_all()

    def _waited_on(self) -> tuple:
        """What the trainer's waits read (closes, sums, gradients, finished members,
        membership, status): a message that changes none of it wakes nobody. Woken at
        every message, each node's trainer thread took the interpreter and the lock from
        this thread once per chunk of a pass."""
        return (len(self.closes), len(self.sums), len(self.grads), len(self._done),
                self.epoch.key, self.status)

    def _set_status(self, status: str, reason: str) -> None:
        if self.status == "running":
            self.status, self.reason = status, reason
            self.stats.events.append({"event": status, "reason": reason, "t": time.time()})
            self.cv.notify_all()

    def _on_grad(self, header: dict, tensors: list[torch.Tensor]) -> None:
        step, node = header["step"], header["node"]
        if step <= self.applied - RETAIN_STEPS:
            return
        if step in self.closes and node not in self.closes[step]:
            return  # a late contribution to a closed step: dropped
        if header["src"] in self.epoch.members or header["src"] == node:
            self._last_heard = self.clock()
        self.grads.setdefault((step, node), tensors)

    def _merge_closes(self, closes: dict) -> bool:
        for s, c in closes.items():
            s = int(s)
            if s in self.closes and self.closes[s] != c:
                self._set_status("left", f"close of step {s} conflicts: {self.closes[s]} here, "
                                 f"{c} in the ring")
                return False
            if s not in self.closes:
                self.closes[s] = list(c)
                self.close_time[s] = time.time()
                self.grace.closed(s, self.clock(), set(self.epoch.members) - set(c))
        return True

    def _pass_sum(self, step: int, tensors: list[torch.Tensor],
                  routes: list[tuple[int, int, int]], origin: int) -> None:
        """Send ``step``'s sum in chunks along ``routes`` (``(first member, direction, last
        member)``, :func:`~trainwright.tokenring.sumpass.pass_routes`), a chunk to each
        route in turn; ``origin`` is the closer (-1: a fetch's answer, not forwarded)."""
        layout = layout_of(tensors)
        for k, pieces in enumerate(chunk_plan(layout, CHUNK_BYTES)):
            chunk = chunk_tensors(tensors, pieces)
            for first, way, last in routes:
                self._send(first, self.epoch.members[first],
                           {"t": "sum", "step": step, "k": k, "origin": origin,
                            "way": way, "last": last, "layout": layout}, chunk)

    def _on_chunk(self, h: dict, tensors: list[torch.Tensor]) -> None:
        """A chunk of a closed sum: store it, forward it the way it came (unless its route
        ends here), and publish the sum once complete."""
        step, k, origin = h["step"], h["k"], h["origin"]
        if step in self.sums or step <= self.applied:
            return
        asm = self._asm.get(step)
        if asm is None:
            asm = self._asm[step] = SumAssembly(h["layout"], CHUNK_BYTES, self._buffers)
        if not asm.add(k, tensors):
            return
        nxt = (self.epoch.successor(self.index) if h["way"] > 0
               else self.epoch.predecessor(self.index))
        if (origin >= 0 and self.index != h["last"] and nxt not in (origin, self.index)
                and nxt in self.epoch.members):
            self._send(nxt, self.epoch.members[nxt], h, tensors)
        if asm.complete:
            self.sums[step] = asm.tensors
            self._assembled.add(step)
            del self._asm[step]

    def _on_tok(self, h: dict, tensors: list[torch.Tensor] = ()) -> None:
        key, src = tuple(h["ep"]["key"]), h["src"]
        if key < self.epoch.key:
            addr = h["ep"].get("members", {}).get(str(src), self._ever.get(src))
            if src not in self.epoch.members and addr is not None:
                # a dropped node still talking: tell it
                self._send(src, addr, {"t": "left", "ep": self.epoch.to_json()})
            return
        tok = Token(h["step"], list(h["contribs"]), h["holder"], h["hop"], h["idle"])
        if key > self.epoch.key:
            if "members" not in h["ep"]:
                self._set_status("left", f"epoch {key} (from node {src}) formed while this "
                                 f"node was out of reach and its membership never came here; "
                                 f"it rejoins with fresh weights")
                return
            ep = Epoch.from_json(h["ep"])
            if self.index not in ep.members:
                self._set_status("left", f"epoch {ep.key} (from node {h['src']}) has members "
                                 f"{ep.order} without this node")
                return
            mine = [s for s in self.closes if s >= tok.step]
            if mine:
                self._set_status("left", f"this node knows close(s) of step(s) {mine} that "
                                 f"epoch {ep.key} does not; it rejoins with fresh weights")
                return
            self.stats.events.append({"event": "epoch", "key": list(ep.key),
                                      "members": ep.order, "t": time.time()})
            self.epoch, self.tok = ep, tok
            self._ever.update(ep.members)
            self.links.keep_only(self.epoch.members)
            self._last_heard = self.clock()
            self._merge_closes(h["closes"])
            self._keep_for_relay(h)
            self._take_sum(tok, tensors)
            return
        if self.tok is not None and tok.hop <= self.tok.hop:
            return  # a retransmission we already acted on
        if not self._merge_closes(h["closes"]):
            return
        self.tok = tok
        self._last_heard = self.clock()
        self._keep_for_relay(h)
        self._take_sum(tok, tensors)
        self._may_close(tok)  # starts this node's grace clock once the quorum is reached

    def _take_sum(self, tok: Token, tensors: list[torch.Tensor]) -> None:
        """Keep the running sum that came with a token this node now holds."""
        if tok.holder == self.index and tok.contribs and tensors:
            self._acc = (tok.step, tuple(tok.contribs), tensors)

    def _keep_for_relay(self, h: dict) -> None:
        """Keep a received token message to send on once if the ring goes quiet.

        A holder that dies while its token broadcast is queued (SIGKILL drops ZeroMQ's
        unsent frames) may have reached some members and not its successor. The successor
        would then drop the dead node from a token one step behind a close the others
        know, and they would have to leave. Any member that got the token relays it after
        ``token_timeout_s`` of silence, before the first announcement of a lost holder
        (``token_timeout_s + succession_s``); a member that has it already ignores it.
        """
        self._last_tok = h  # Links.send sets src, inc and sq anew
        self._retx_done = False

    # ---------------------------------------------------------------- holder
    def _act(self) -> None:
        """The holder's turn: add this node's gradient to the running sum if ready; close the
        step if the rule allows; else hand the token to a ready node, or keep it (and its
        sum) while nobody is ready, sending it on after a quarter of ``token_timeout_s`` so
        the others keep hearing from the ring."""
        t = self.tok
        if t.step > self.total:
            return  # the run is over: the token stops here
        me = (self.epoch.key, t.hop)
        if self._acted_hop != me:
            self._acted_hop, self._hold_since = me, self.clock()
        self._check_carry(t)
        offer = self._offer
        if offer is not None and offer[0] == t.step and self.index not in t.contribs:
            step, grads = offer
            self.grads[(step, self.index)] = grads
            base = self._acc[2] if t.contribs else None
            acc = list(grads) if base is None else [a + g for a, g in zip(base, grads,
                                                                           strict=True)]
            t.contribs.append(self.index)
            self._acc = (t.step, tuple(t.contribs), acc)
            t.idle = 0
            if step not in self.stats.contributed:
                self.stats.contributed.append(step)
        if self._may_close(t):
            self._close(t)
            ready = self._ready_missing(t)
            nxt = ready[0] if ready else self.index
        else:
            ready = self._ready_missing(t)
            if ready:
                nxt = ready[0]
            elif self.clock() - self._hold_since < self._hold_limit(t):
                return  # nobody else ready: keep the token (and its sum) here
            else:
                nxt = self.epoch.successor(self.index)
                t.idle += 1
        if self._admit is not None:
            self._admit_standby()
            if nxt not in self.epoch.members:
                nxt = self.epoch.successor(self.index)
        t.holder = nxt
        t.hop += 1
        self._send_token()

    def _hold_limit(self, t: Token) -> float:
        """How long a holder with nobody else ready keeps the token before sending it on:
        ready nodes say so (``want``), so passing it sooner finds nobody; a quarter of
        ``token_timeout_s`` keeps the others hearing from the ring well inside the time-out
        after which they would presume the holder lost."""
        return self.times.token_timeout_s / 4

    def _ready_missing(self, t: Token) -> list[int]:
        """Members (other than this node) that said their gradient of the token's step is
        ready and are not in its sum yet, nearest first in ring order."""
        order = self.epoch.order
        ready = [m for m in order if m != self.index and m not in t.contribs
                 and self.grace.is_ready(t.step, m)]
        return sorted(ready, key=lambda m: ring_distance(order, self.index, m))

    def _check_carry(self, t: Token) -> None:
        """A token whose running sum did not reach this holder (its holder died, or a relay
        or a new epoch's announcement carried the header only) restarts the step's sum:
        the contributors' offers stand, so they add again when the token comes."""
        if t.contribs and (self._acc is None or self._acc[:2] != (t.step, tuple(t.contribs))):
            log.warning("token ring node %d: the running sum of step %d (contributions %s) "
                        "did not reach this holder; the step's sum starts again", self.index,
                        t.step, t.contribs)
            self.stats.dropped_sums += 1
            t.contribs = []
            self._acc = None

    def _close(self, t: Token) -> None:
        """Close the token's step with its running sum, start the sum's pass, open the next
        step."""
        total = self._acc[2]
        self.closes[t.step] = list(t.contribs)
        self.close_time[t.step] = time.time()
        self.grace.closed(t.step, self.clock(), set(self.epoch.members) - set(t.contribs))
        self.sums[t.step] = total
        chunks = len(chunk_plan(layout_of(total), CHUNK_BYTES))
        self._pass_sum(t.step, total, pass_routes(self.epoch.order, self.index, chunks),
                       origin=self.index)
        t.step, t.contribs, t.idle = t.step + 1, [], 0
        self._acc = None
        self.cv.notify_all()

    def _may_close(self, t: Token) -> bool:
        """The close rule: every member contributed; or the contributions met the fraction
        rule (the floor), no member that said its gradient is ready is still missing, and
        the adaptive grace (:mod:`~trainwright.tokenring.grace`: twice the on-time nodes'
        arrival spread, at most ``close_grace_s``) has passed since the quorum, so that a
        node only a little later than the others is not thrown away; no grace when every
        missing member is known to run far behind (it missed the last closes by more than
        ``close_grace_s``). The grace runs on
        each node's own clock from when it first saw the quorum (no clock agreement
        between hosts needed)."""
        members = len(self.epoch.members)
        now = self.clock()
        needed = contributors_needed(self.close_fraction, members)
        self.grace.measure(members, needed, now)
        if len(t.contribs) < needed:
            return False
        if len(t.contribs) >= members:
            return True
        since = self._quorum_at.setdefault(t.step, now)
        if any(self.grace.is_ready(t.step, m) for m in self.epoch.members
               if m not in t.contribs):
            return False  # ready, its contribution on its way: never cut off
        for old in [k for k in self._quorum_at if k < t.step - CLOSE_WINDOW]:
            del self._quorum_at[old]
        self.grace.forget(t.step - CLOSE_WINDOW)
        missing = [m for m in self.epoch.members if m not in t.contribs]
        if all(self.grace.known_late(m, now) for m in missing):
            return True  # only nodes far behind are missing: the grace would wait for nothing
        return now - since >= self.grace.grace_s()

    def _admit_standby(self) -> None:
        weights, step, extra = self._admit
        self._admit = None
        new = self.rdzv.take_standby(exclude=set(self.epoch.members))
        if not new:
            return
        self.epoch = self.epoch.with_nodes(new, self.index)
        self._ever.update(new)
        self.tok.hop = 0
        self.stats.events.append({"event": "admit", "nodes": sorted(new), "at_step": step,
                                  "key": list(self.epoch.key), "t": time.time()})
        log.info("token ring: node(s) %s rejoin after step %d", sorted(new), step)
        for i, addr in new.items():
            self.send_welcome(i, addr, step, weights, extra)

    # ---------------------------------------------------------------- failures
    def _check_silence(self) -> None:
        """Relay a quiet ring's last token; declare a silent holder or predecessor lost.

        The token now visits only nodes that are ready, so a dead node that never holds it
        would go unnoticed: every member sends its successor a few bytes (``alive``) every
        quarter of ``token_timeout_s``, and the successor of a node silent for
        ``token_timeout_s + succession_s`` declares it lost, as the first successor of a
        silent holder does.
        """
        if self.tok is None or self.status != "running":
            return
        T, now = self.times, self.clock()
        order = self.epoch.order
        over = self.total in self.closes  # members linger (finish): only the watch goes on
        if len(order) > 1 and self.index in self.epoch.members:
            succ = self.epoch.successor(self.index)
            if now - self._alive_sent > T.token_timeout_s / 4:
                self._alive_sent = now
                self._send(succ, self.epoch.members[succ], {"t": "alive"})
            pred = order[order.index(self.index) - 1]
            if self._pred is None or self._pred[0] != self.epoch.key:
                self._pred = (self.epoch.key, now)
            heard = max(self._heard.get(pred, float("-inf")), self._pred[1])
            if ((over or pred != self.tok.holder) and pred not in self._done
                    and now - heard > announce_delay(1, T.token_timeout_s, T.succession_s)):
                self._announce_lost(pred, now - heard)
                return
        if over:
            return
        quiet = now - self._last_heard
        if (self._last_tok is not None and not self._retx_done and quiet > T.token_timeout_s
                and self._last_tok["ep"]["key"] == list(self.epoch.key)):
            self._retx_done = True
            self.stats.retransmissions += 1
            last = self._last_tok  # relayed whole: the membership, and the closes known here
            tok = Token(last["step"], last["contribs"], last["holder"], last["hop"], last["idle"])
            self._broadcast(token_header(tok, self.epoch, self.closes, to_holder=False,
                                         retx=True))
        holder = self.tok.holder
        if holder == self.index or holder not in self.epoch.members:
            return
        k = ring_distance(self.epoch.order, holder, self.index)
        if quiet > announce_delay(k, T.token_timeout_s, T.succession_s):
            self._announce_lost(holder, quiet)

    def _announce_lost(self, lost: int, quiet: float) -> None:
        new = self.epoch.without(lost, self.index)
        self.stats.events.append({"event": "lost", "node": lost, "quiet_s": round(quiet, 3),
                                  "key": list(new.key), "members": new.order, "t": time.time()})
        log.warning("token ring node %d: node %d silent for %.2f s; dropping it (members %s)",
                    self.index, lost, quiet, new.order)
        if len(new.members) < self.min_nodes:
            lost_all = sorted(self._ever.keys() - set(new.members))
            reason = (f"token ring failed after step {self.tok.step - 1}: node(s) {lost_all} "
                      f"lost or absent, {len(new.members)} left (node(s) {new.order}) < "
                      f"tokenring.min_nodes = {self.min_nodes}")
            self.epoch = new
            self._broadcast({"t": "fail", "ep": new.to_json(), "reason": reason})
            self._set_status("failed", reason)
            return
        t = self.tok
        self.epoch = new
        holder = new.successor(lost) if t.holder == lost else t.holder
        self.tok = Token(t.step, [c for c in t.contribs if c in new.members], holder, 0, 0)
        self.links.keep_only(self.epoch.members)
        self._acted_hop = None
        self._send_token()
        self.cv.notify_all()
