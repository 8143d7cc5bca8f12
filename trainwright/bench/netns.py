"""A two-tier network on one host: nodes of ranks, fast inside a node, slow between nodes.

One network namespace per rank, each with one veth interface ``eth0`` whose peer sits on a
bridge in a *switch* namespace. Addresses exist only inside the namespaces
(``10.77.<node+1>.<local+1>/16``), so nothing leaks to the host. Each rank's ``eth0`` has an
HTB root qdisc: a u32 filter sends packets for other nodes' subnets to class ``1:10``
(``inter_rate``, e.g. 1 Gbit/s); everything else matches no class and leaves unshaped
(HTB's direct queue). ``tc`` counts the bytes of class ``1:10``: the inter-node bytes each
rank sent (:func:`inter_node_bytes`).

Needs root (CAP_NET_ADMIN) and iproute2; :class:`NetnsUnavailable` says so plainly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from trainwright.errors import TrainwrightError

__all__ = ["NetnsUnavailable", "TwoTierNetwork", "inter_node_bytes"]

SUBNET = "10.77"
INTER_CLASS = "1:10"


class NetnsUnavailable(TrainwrightError):
    """The emulated network cannot be built here (no privilege, no iproute2)."""


def _run(cmd: list[str], timeout: float = 20.0) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise NetnsUnavailable(f"{cmd[0]} is not installed; install iproute2") from exc
    if res.returncode:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
    return res.stdout


@dataclass
class TwoTierNetwork:
    """``nodes x ranks_per_node`` rank namespaces on a bridge; inter-node egress shaped.

    Use as a context manager: the namespaces are removed on exit, whatever happened.

    Args:
        nodes: emulated nodes.
        ranks_per_node: ranks per node.
        inter_rate: ``tc`` rate of each rank's traffic to other nodes, e.g. ``"1gbit"``.
        mtu: interface MTU (the same everywhere).
    """

    nodes: int
    ranks_per_node: int
    inter_rate: str = "1gbit"
    mtu: int = 1500
    burst: str = "1m"
    prefix: str = field(default_factory=lambda: f"tw{os.getpid() % 100000}")
    created: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        """Ranks in the network."""
        return self.nodes * self.ranks_per_node

    def ns(self, rank: int) -> str:
        """Namespace name of ``rank``."""
        return f"{self.prefix}r{rank}"

    @property
    def switch(self) -> str:
        """Namespace holding the bridge."""
        return f"{self.prefix}sw"

    def addr(self, rank: int) -> str:
        """IPv4 address of ``rank`` (inside its namespace only)."""
        node, local = divmod(rank, self.ranks_per_node)
        return f"{SUBNET}.{node + 1}.{local + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ns(rank)]

    @staticmethod
    def check_privilege() -> None:
        """Raise :class:`NetnsUnavailable` unless we are root with ``ip`` and ``tc``."""
        if os.geteuid() != 0:
            raise NetnsUnavailable(
                "building the emulated two-tier network needs root (network namespaces and tc "
                "need CAP_NET_ADMIN); run the benchmark as root, or add --loopback to measure "
                "on 127.0.0.1 without the emulated network")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"`{tool}` is not installed; install iproute2")

    def create(self) -> TwoTierNetwork:
        """Build the namespaces, bridge, addresses and tc classes."""
        self.check_privilege()
        sw = self.switch
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu), "up"])
        for r in range(self.world):
            ns, a, b = self.ns(r), f"{self.prefix}a{r}", f"{self.prefix}b{r}"
            self._add_ns(ns)
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            _run(["ip", "link", "set", a, "netns", ns])
            _run(["ip", "link", "set", b, "netns", sw])
            _run(["ip", "-n", ns, "link", "set", a, "name", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu)])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/16", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", sw, "link", "set", b, "mtu", str(self.mtu), "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", b, "up"])
            self._shape(r)
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)

    def _shape(self, rank: int) -> None:
        """HTB on the rank's eth0: other nodes' subnets -> 1:10 at ``inter_rate``; the
        default class 99 does not exist, so intra-node packets go out unshaped."""
        tc = ["ip", "netns", "exec", self.ns(rank), "tc"]
        _run(tc + ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99"])
        _run(tc + ["class", "add", "dev", "eth0", "parent", "1:", "classid", INTER_CLASS, "htb",
                   "rate", self.inter_rate, "ceil", self.inter_rate, "burst", self.burst,
                   "cburst", self.burst])
        mine = rank // self.ranks_per_node
        for node in range(self.nodes):
            if node != mine:
                _run(tc + ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                           "prio", "1", "u32", "match", "ip", "dst", f"{SUBNET}.{node + 1}.0/24",
                           "flowid", INTER_CLASS])

    def destroy(self) -> None:
        """Delete every namespace this object created (their veths go with them)."""
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)

    def __enter__(self) -> TwoTierNetwork:
        try:
            return self.create()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc) -> None:
        self.destroy()


def inter_node_bytes(dev: str = "eth0") -> int | None:
    """Bytes sent so far through the inter-node class of ``dev`` in *this* process's
    namespace (None when there is no such class: not in an emulated network)."""
    try:
        out = subprocess.run(["tc", "-s", "class", "show", "dev", dev],
                             capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    # text form (this tc ignores -j for classes): "class htb 1:10 ...\n Sent N bytes M pkt"
    m = re.search(rf"class htb {INTER_CLASS} .*?\n\s*Sent (\d+) bytes", out.stdout)
    return int(m.group(1)) if m else None
