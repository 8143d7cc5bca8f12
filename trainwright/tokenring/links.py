"""The token ring's links: one PUSH socket per peer, with per-link sequence numbers.

Every node binds one PULL socket (owned by :class:`~trainwright.tokenring.ring.TokenRing`)
and keeps one PUSH socket per peer here, with an unlimited high-water mark, so ZeroMQ
queues rather than drops; TCP keeps each link in order. Each message carries this node's
index, its incarnation (a random number per process, so a restarted node starts a new
sequence) and a per-link sequence number; :meth:`Links.check` finds gaps on the receiving
side.
"""

from __future__ import annotations

import random

import torch
import zmq

from trainwright.tokenring.wire import pack

__all__ = ["Links"]


class Links:
    """This node's outgoing sockets and the sequence numbers of both directions."""

    def __init__(self, ctx: zmq.Context, index: int):
        self.ctx, self.index = ctx, index
        self.inc = random.getrandbits(48)
        self._push: dict[int, tuple[str, zmq.Socket]] = {}
        self._seq_out: dict[int, int] = {}
        self._seq_in: dict[tuple[int, int], int] = {}
        self.tensor_bytes_sent = 0
        """Tensor bytes sent in the protocol's messages (welcomes excluded: one-off)."""
        self.header_bytes_sent = 0
        self.welcome_bytes_sent = 0
        """Weights and optimizer state sent to nodes joining (once per join, not per step)."""

    def _sock(self, idx: int, addr: str) -> zmq.Socket:
        have = self._push.get(idx)
        if have is not None and have[0] == addr:
            return have[1]
        if have is not None:
            have[1].close(0)
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)  # unlimited: queue, never drop
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        self._push[idx] = (addr, s)
        self._seq_out[idx] = 0
        return s

    def send(self, idx: int, addr: str, header: dict, tensors: list[torch.Tensor] = ()) -> None:
        """Send ``header`` and raw ``tensors`` to node ``idx`` at ``addr`` (queued, in order)."""
        sock = self._sock(idx, addr)
        self._seq_out[idx] += 1
        frames = pack({**header, "src": self.index, "inc": self.inc,
                       "sq": self._seq_out[idx]}, list(tensors))
        if header["t"] == "welcome":
            self.welcome_bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes
                                           for f in frames)
        else:
            self.tensor_bytes_sent += sum(f.nbytes for f in frames[1:])
            self.header_bytes_sent += len(frames[0])
        sock.send_multipart(frames, copy=False)

    def broadcast(self, members: dict[int, str], header: dict,
                  tensors: list[torch.Tensor] = ()) -> None:
        """Send to every member but this node."""
        for i, addr in members.items():
            if i != self.index:
                self.send(i, addr, header, tensors)

    def keep_only(self, members: dict[int, str]) -> None:
        """Close the links to nodes that are no longer members."""
        for i in [i for i in self._push if i not in members]:
            self._push.pop(i)[1].close(0)

    def check(self, header: dict) -> int:
        """Record a received message's sequence number; returns how many messages from its
        sender were lost before it (0 in order, or for the first message of a sender)."""
        key = (header["src"], header["inc"])
        expect = self._seq_in.get(key, 0) + 1
        lost = header["sq"] - expect if key in self._seq_in and header["sq"] != expect else 0
        self._seq_in[key] = header["sq"]
        return lost

    def expect_from(self, src: int, inc: int, seq: int) -> None:
        """Continue the sequence check of ``(src, inc)`` after a message read outside."""
        self._seq_in[(src, inc)] = seq

    def close(self) -> None:
        """Close every outgoing socket."""
        for _, s in self._push.values():
            s.close(0)
        self._push.clear()
