"""Token-ring membership: rendezvous, formation, epochs, staggered failure time-outs.

* **Rendezvous and formation.** The node that binds the rendezvous address hosts it (a
  ZeroMQ ROUTER; joiners use a DEALER, so every reply reaches the one who asked). Nodes
  join in turn; each asks for an index (a restarted node asks for its old one) and gets the
  requested one if free, else the lowest free one. Formation closes once ``nodes`` have
  joined, or after ``formation_quiet_s`` without a new join; later arrivals are told to
  wait as *standby* and are admitted at a batch boundary.
* **Epochs.** A membership is an :class:`Epoch`: an ordering key ``(number, announcer)``
  and the members ``{index: address}``; ring order is index order. Messages of an older
  epoch are ignored; a newer epoch is adopted from any message that carries it.
* **Staggered time-outs.** After ``token_timeout_s`` of silence every member sends on the
  last token message it sent or received (once); the k-th successor of the presumed
  holder declares it lost after
  ``token_timeout_s + k * succession_s`` (:func:`announce_delay`), so the nearest live
  successor speaks first and the others hear it before their own turn.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from trainwright.errors import CommError

__all__ = ["Epoch", "announce_delay", "ring_distance", "Rendezvous", "join_rendezvous",
           "FormationResult", "local_address", "endpoint_host"]


@dataclass
class Epoch:
    """One membership of the ring: ordering key and members (index -> ZeroMQ address)."""

    key: tuple[int, int]
    members: dict[int, str]

    @property
    def order(self) -> list[int]:
        """Member indices in ring order."""
        return sorted(self.members)

    def successor(self, index: int) -> int:
        """The member after ``index`` in the ring (``index`` need not be a member)."""
        order = self.order
        later = [i for i in order if i > index]
        return later[0] if later else order[0]

    def predecessor(self, index: int) -> int:
        """The member before ``index`` in the ring (``index`` need not be a member)."""
        order = self.order
        earlier = [i for i in order if i < index]
        return earlier[-1] if earlier else order[-1]

    def first(self) -> int:
        """The first node: the lowest member index (it saves, admits and reports)."""
        return self.order[0]

    def without(self, lost: int, announcer: int) -> Epoch:
        """The next epoch, announced by ``announcer``, with ``lost`` removed."""
        return Epoch((self.key[0] + 1, announcer),
                     {i: a for i, a in self.members.items() if i != lost})

    def with_nodes(self, new: dict[int, str], announcer: int) -> Epoch:
        """The next epoch, announced by ``announcer``, with ``new`` members added."""
        return Epoch((self.key[0] + 1, announcer), {**self.members, **new})

    def to_json(self) -> dict:
        """Plain form for message headers."""
        return {"key": list(self.key), "members": {str(i): a for i, a in self.members.items()}}

    @classmethod
    def from_json(cls, d: dict) -> Epoch:
        """Inverse of :meth:`to_json`."""
        return cls(tuple(d["key"]), {int(i): a for i, a in d["members"].items()})


def ring_distance(order: list[int], frm: int, to: int) -> int:
    """Hops from ``frm`` forward to ``to`` along ``order`` (``frm`` may be absent)."""
    ring = sorted(set(order) | {frm})
    n, i = len(ring), ring.index(frm)
    for k in range(1, n + 1):
        if ring[(i + k) % n] == to:
            return k
    raise ValueError(f"node {to} is not in the ring {order}")


def announce_delay(k: int, token_timeout_s: float, succession_s: float) -> float:
    """Silence after which the ``k``-th successor of the presumed holder declares it lost."""
    return token_timeout_s + k * succession_s


@dataclass
class FormationResult:
    """What a node learns from the rendezvous: its index and, if formed, the members."""

    index: int
    standby: bool
    members: dict[int, str] = field(default_factory=dict)


class Rendezvous:
    """The formation host: a ROUTER bound at the rendezvous address.

    Args:
        ctx: ZeroMQ context.
        endpoint: ``tcp://host:port`` to bind.
        nodes: index range (``0 .. nodes-1``) and the size at which formation closes at once.
        quiet_s: formation closes after this long without a new join.
        clock: monotonic seconds, the time base of ``quiet_s`` and of :meth:`form`'s deadline.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, nodes: int, quiet_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.nodes, self.quiet_s = nodes, quiet_s
        self.members: dict[int, str] = {}
        self.standby: dict[int, str] = {}
        self.formed = False
        self._waiting: list[tuple[bytes, int]] = []

    def _grant(self, want: int, taken: set[int]) -> int | None:
        if 0 <= want < self.nodes and want not in taken:
            return want
        free = [i for i in range(self.nodes) if i not in taken]
        return free[0] if free else None

    def handle(self) -> None:
        """Answer every pending join; after formation joiners become standby."""
        while self.sock.poll(0):
            ident, raw = self.sock.recv_multipart()
            req = json.loads(raw)
            if not self.formed:
                idx = self._grant(req["want"], set(self.members))
                if idx is None:
                    self.sock.send_multipart([ident, json.dumps({"t": "full"}).encode()])
                    continue
                self.members[idx] = req["addr"]
                self._waiting.append((ident, idx))
                self._last_join = self.clock()
            else:
                # a restarted node may ask for the index of its dead incarnation, which is
                # still a member until the ring declares it lost: grant it, admit it later
                idx = self._grant(req["want"], set(self.standby))
                if idx is None:
                    self.sock.send_multipart([ident, json.dumps({"t": "full"}).encode()])
                    continue
                self.standby[idx] = req["addr"]
                self.sock.send_multipart([ident, json.dumps({"t": "standby", "index": idx})
                                          .encode()])

    def form(self, host_index: int, host_addr: str, min_nodes: int, deadline_s: float
             ) -> dict[int, str]:
        """Host formation: wait for joins, close it, tell every joiner the members.

        Raises:
            CommError: fewer than ``min_nodes`` joined before ``deadline_s``.
        """
        self.members[host_index] = host_addr
        self._last_join = self.clock()
        end = self.clock() + deadline_s
        while True:
            self.sock.poll(20)
            self.handle()
            quiet = self.clock() - self._last_join > self.quiet_s
            if len(self.members) >= self.nodes or (quiet and len(self.members) >= min_nodes):
                break
            if self.clock() > end:
                raise CommError(f"token ring formation: only {len(self.members)} node(s) joined "
                                f"in {deadline_s:.0f} s, need tokenring.min_nodes = {min_nodes}; "
                                f"start the other nodes with the same rendezvous address")
        self.formed = True
        msg = {"t": "formed", "members": {str(i): a for i, a in self.members.items()}}
        for ident, idx in self._waiting:
            self.sock.send_multipart([ident, json.dumps({**msg, "index": idx}).encode()])
        return dict(self.members)

    def take_standby(self, exclude: set[int]) -> dict[int, str]:
        """Remove and return the standby nodes waiting to be admitted, except those whose
        index is in ``exclude`` (still a member: its old incarnation is not yet declared lost)."""
        out = {i: a for i, a in self.standby.items() if i not in exclude}
        self.standby = {i: a for i, a in self.standby.items() if i in exclude}
        return out

    def close(self) -> None:
        """Close the socket."""
        self.sock.close(0)


def join_rendezvous(ctx: zmq.Context, endpoint: str, want: int, addr: str, deadline_s: float
                    ) -> FormationResult:
    """Join the ring at ``endpoint``: formed member, or standby when formation is closed.

    Raises:
        CommError: no answer before ``deadline_s``, or every index is taken.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(json.dumps({"want": want, "addr": addr}).encode())
        if not sock.poll(int(deadline_s * 1000)):
            raise CommError(f"token ring rendezvous {endpoint}: no answer in {deadline_s:.0f} s; "
                            f"check that the first node is running there")
        rep = json.loads(sock.recv())
    finally:
        sock.close(0)
    if rep["t"] == "full":
        raise CommError(f"token ring rendezvous {endpoint}: every node index is taken; "
                        f"raise tokenring.nodes")
    if rep["t"] == "standby":
        return FormationResult(rep["index"], True)
    return FormationResult(rep["index"], False,
                           {int(i): a for i, a in rep["members"].items()})


def endpoint_host(endpoint: str) -> str:
    """``host`` of ``tcp://host:port``."""
    return endpoint.split("//", 1)[-1].rsplit(":", 1)[0]


def local_address(endpoint: str) -> str:
    """This machine's IPv4 address on the route to ``endpoint``'s host: the address other
    nodes reach this one at (``127.0.0.1`` for a loopback rendezvous). A UDP socket is
    connected to find the route; no packet is sent."""
    try:
        ip = socket.gethostbyname(endpoint_host(endpoint))
    except OSError as exc:
        raise CommError(f"token ring rendezvous {endpoint}: cannot resolve its host ({exc}); "
                        f"set tokenring.rendezvous = \"tcp://HOST:PORT\"") from None
    if ip.startswith("127.") or ip == "0.0.0.0":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as exc:
            raise CommError(f"token ring rendezvous {endpoint}: no route to {ip} ({exc})"
                            ) from None
        return s.getsockname()[0]
