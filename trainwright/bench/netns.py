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

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainwright.errors import TrainwrightError

__all__ = ["NetnsUnavailable", "TwoTierNetwork", "inter_node_bytes", "interface_bytes", "emulated",
           "run_ranks"]

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


def interface_bytes(dev: str = "eth0") -> int | None:
    """Bytes ``dev`` has transmitted so far in this process's namespace, as the kernel
    counts them (``/sys/class/net/DEV/statistics/tx_bytes``; None without such a device)."""
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def emulated(net: TwoTierNetwork | None):
    """Build ``net`` (None: nothing to build) for the block and remove it afterwards, also
    on failure, Ctrl-C or SIGTERM / SIGHUP (turned into KeyboardInterrupt meanwhile)."""
    handlers = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            handlers[sig] = signal.signal(sig, _raise_interrupt)
        except ValueError:  # not the main thread: the caller handles signals
            pass
    try:
        if net is not None:
            net.create()
        yield net
    finally:
        if net is not None:
            net.destroy()
        for sig, old in handlers.items():
            signal.signal(sig, old)


def run_ranks(module: str, tmp: str, world: int, net: TwoTierNetwork | None, *,
              timeout_s: float, total: int, label: str, env_for=None) -> None:
    """Run ``python -m MODULE --worker TMP RANK`` for every rank and wait for all of them.

    With ``net`` each rank runs inside its namespace and gloo binds to ``eth0``; without,
    on 127.0.0.1. Rank 0 may write ``"done total"`` to ``TMP/progress`` for the progress
    bar. Each rank's output goes to ``TMP/rankR.log``; a rank that fails, or the deadline
    passing, stops every rank and raises with that rank's last lines.

    Args:
        env_for: ``rank -> dict`` of extra environment variables.
    """
    from rich.progress import Progress

    from trainwright.dist.ports import free_port

    port = 29511 if net is not None else free_port()  # inside the namespaces: nothing else
    procs = []
    try:
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": net.addr(0) if net else "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "GLOO_SOCKET_IFNAME": "eth0" if net else "lo",
                   **(env_for(rank) if env_for else {})}
            cmd = [sys.executable, "-m", module, "--worker", tmp, str(rank)]
            log = open(Path(tmp) / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen((net.exec_prefix(rank) if net else []) + cmd,
                                           env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        with Progress(transient=True) as bar:
            task = bar.add_task(label, total=total)
            while any(p.poll() is None for p, _ in procs):
                _raise_if_failed(procs, tmp)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: ranks still running after {timeout_s} s")
                prog = Path(tmp) / "progress"
                if prog.exists():
                    with contextlib.suppress(ValueError, IndexError):
                        bar.update(task, completed=int(prog.read_text().split()[0]))
                time.sleep(0.5)
        _raise_if_failed(procs, tmp)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()


def _raise_if_failed(procs: list, tmp: str) -> None:
    for rank, (p, _) in enumerate(procs):
        if p.poll() not in (None, 0):
            tail = (Path(tmp) / f"rank{rank}.log").read_text()[-3000:]
            raise RuntimeError(f"benchmark rank {rank} exited with code {p.returncode}:\n{tail}")
