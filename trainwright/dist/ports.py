"""Free TCP ports on the loopback interface, for local rendezvous stores and tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["ephemeral_range", "free_port"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for ``bind(0)`` and as connections' source ports
    (Linux's ``ip_local_port_range``; IANA's 49152-65535 where it cannot be read)."""
    try:
        lo, hi = map(int, _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range.

    Between this call and the bind that uses the port (a rendezvous host starting up),
    a port from the ephemeral range can go to any socket bound to port 0 or to an
    outgoing connection (a node retrying its connection to that same rendezvous can even
    connect to itself), so it is drawn from 10000-65535 less that range.
    """
    lo, hi = ephemeral_range()
    outside = [*range(10000, lo), *range(hi + 1, 65536)]
    pick = random.SystemRandom()  # not the seeded module state: processes draw apart
    for _ in range(200 if outside else 0):
        port = pick.choice(outside)
        if _bindable(port):
            return port
    with socket.socket() as s:  # nothing free outside the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
