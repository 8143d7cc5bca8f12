"""Devices and the links between them: memory per device, a bandwidth matrix, presets.

The peer-swap planner needs to know, for every pair of devices, how fast tensors move
between them (NVLink is several times faster than PCIe to the host, and a GPU has several
NVLinks to different peers), and how much memory each device has. A
:class:`DeviceTopology` is that table: ``bandwidth[i][j]`` bytes/s from device ``i`` to
``j`` (0 where there is no direct path worth using), ``host_bandwidth[i]`` bytes/s between
device ``i`` and host memory, ``memory[i]`` bytes.

Sources:

* presets for common boxes (:data:`PRESETS`): ``nvswitch8`` (8 GPUs, all-to-all through
  NVSwitch, DGX A100/H100 style), ``dgx1`` (the 8-GPU NVLink hybrid cube-mesh of DGX-1 V100:
  GPUs 0-3 and 4-7 fully connected, ``i <-> i+4``, some pairs doubled, six links per GPU),
  ``pcie8`` (8 GPUs, PCIe only);
* :func:`parse_nvidia_smi_topo` reads ``nvidia-smi topo -m`` (``NV#`` = # NVLinks, PIX/PXB/
  PHB/NODE/SYS = PCIe paths) where a GPU exists;
* :func:`trainwright.dist.probe.measure_p2p` times a real ``torch.distributed`` send/recv
  between every pair of local ranks (gloo on CPU here, NCCL on CUDA), and
  :func:`trainwright.dist.probe.from_nvidia_smi` runs the command; both fill in this table.

Pure: no torch here.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from trainwright.errors import ConfigError

__all__ = ["DeviceTopology", "PRESETS", "preset", "parse_nvidia_smi_topo", "cluster",
           "GB"]

GB = 1e9
NVLINK2_GBPS = 25.0
"""One NVLink 2 (V100) direction, GB/s."""
PCIE3_GBPS = 12.0
"""A PCIe 3 x16 direction as measured in practice, GB/s."""

CPU_LOOPBACK_GBPS = 2.6
"""gloo send/recv between two local processes on this 2-core host, GB/s (docs/planner.md)."""
CPU_COPY_GBPS = 5.4
"""A host memcpy on this host, GB/s (docs/planner.md)."""

# Links per pair in the DGX-1 V100 hybrid cube-mesh, as `nvidia-smi topo -m` prints it.
_DGX1_LINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2,
    (5, 7): 1, (6, 7): 2,
}


@dataclass
class DeviceTopology:
    """Devices with memory and the bandwidth of every directed link.

    Attributes:
        name: what the table describes (preset name, "nvidia-smi", "measured").
        memory: bytes of each device.
        bandwidth: ``bandwidth[i][j]`` bytes/s from device ``i`` to device ``j`` (diagonal 0).
        host_bandwidth: bytes/s between each device and host memory.
        node_size: devices per node (for clusters of identical nodes; the matrix describes
            one node, and devices of different nodes talk at ``inter_node_bandwidth``).
        inter_node_bandwidth: bytes/s per device between nodes.
    """

    name: str
    memory: list[int]
    bandwidth: list[list[float]]
    host_bandwidth: list[float]
    node_size: int = 0
    inter_node_bandwidth: float = 0.0
    labels: list[str] = field(default_factory=list)
    kind: str = "cuda"
    """What the devices are: ``"cuda"`` (GPUs; every preset) or ``"cpu"`` (ranks on one
    host, the ``cpu`` preset); ``trainwright run --plan`` refuses a plan made for another
    kind than the machine has."""

    def __post_init__(self):
        n = len(self.memory)
        if n == 0:
            raise ConfigError("a device topology needs at least one device")
        if len(self.bandwidth) != n or any(len(r) != n for r in self.bandwidth) \
                or len(self.host_bandwidth) != n:
            raise ConfigError(f"device topology {self.name!r}: memory has {n} devices but the "
                              f"bandwidth matrix or host_bandwidth list has another size; "
                              f"give an n x n matrix and n host bandwidths")
        if any(b < 0 for r in self.bandwidth for b in r) or any(b <= 0 for b in
                                                                 self.host_bandwidth):
            raise ConfigError(f"device topology {self.name!r}: bandwidths must be >= 0 "
                              f"(host bandwidths > 0)")
        if not self.node_size:
            self.node_size = n

    @property
    def n(self) -> int:
        """Number of devices in the table."""
        return len(self.memory)

    def bw(self, i: int, j: int) -> float:
        """Bytes/s from device ``i`` to device ``j`` (0 if no direct link)."""
        return self.bandwidth[i][j]

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return {"name": self.name, "memory": self.memory, "bandwidth": self.bandwidth,
                "host_bandwidth": self.host_bandwidth, "node_size": self.node_size,
                "inter_node_bandwidth": self.inter_node_bandwidth, "labels": self.labels,
                "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict) -> DeviceTopology:
        """Inverse of :meth:`to_dict` (e.g. a topology JSON file)."""
        try:
            return cls(name=d.get("name", "custom"), memory=[int(x) for x in d["memory"]],
                       bandwidth=[[float(x) for x in r] for r in d["bandwidth"]],
                       host_bandwidth=[float(x) for x in d["host_bandwidth"]],
                       node_size=int(d.get("node_size", 0)),
                       inter_node_bandwidth=float(d.get("inter_node_bandwidth", 0.0)),
                       labels=list(d.get("labels", [])), kind=str(d.get("kind", "cuda")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"device topology: {exc!s}; need keys memory (bytes per device), "
                              f"bandwidth (n x n bytes/s) and host_bandwidth (n bytes/s)") from None

    def automorphisms(self) -> list[tuple[int, ...]]:
        """Device permutations that leave memory and every bandwidth unchanged.

        Used for symmetry pruning of the mapping search: two mappings related by such a
        permutation score the same. Found by backtracking (cheap for n <= 16).
        """
        n = self.n
        if n > 16:
            return [tuple(range(n))]
        off = {b for i, r in enumerate(self.bandwidth) for j, b in enumerate(r) if i != j}
        if len(off) == 1 and len(set(self.memory)) == 1 and len(set(self.host_bandwidth)) == 1:
            return list(itertools.permutations(range(n)))  # all devices alike: every order
        out: list[tuple[int, ...]] = []
        perm: list[int] = []
        used = [False] * n

        def ok(i: int, j: int) -> bool:
            if self.memory[i] != self.memory[j] or self.host_bandwidth[i] != \
                    self.host_bandwidth[j]:
                return False
            return all(self.bandwidth[i][k] == self.bandwidth[j][perm[k]] and
                       self.bandwidth[k][i] == self.bandwidth[perm[k]][j] for k in range(i))

        def go(i: int) -> None:
            if i == n:
                out.append(tuple(perm))
                return
            for j in range(n):
                if not used[j] and ok(i, j):
                    used[j] = True
                    perm.append(j)
                    go(i + 1)
                    perm.pop()
                    used[j] = False

        go(0)
        return out


def _from_links(name: str, n: int, links: dict[tuple[int, int], int], per_link: float,
                fallback: float, memory: int, host: float) -> DeviceTopology:
    bw = [[0.0 if i == j else fallback for j in range(n)] for i in range(n)]
    for (i, j), k in links.items():
        bw[i][j] = bw[j][i] = k * per_link
    return DeviceTopology(name, [memory] * n, bw, [host] * n)


def preset(name: str, memory_bytes: int = 32 * 2**30) -> DeviceTopology:
    """A preset topology by name (see :data:`PRESETS`), every device with ``memory_bytes``.

    Raises:
        ConfigError: unknown name.
    """
    n = 8
    host = PCIE3_GBPS * GB
    if name == "nvswitch8":  # A100 class: 12 NVLink 3 links per GPU into the switch, 300 GB/s
        links = {(i, j): 12 for i in range(n) for j in range(i + 1, n)}
        return _from_links(name, n, links, NVLINK2_GBPS * GB, 0.0, memory_bytes, 2 * host)
    if name == "dgx1":  # pairs without NVLink go through PCIe switches and the CPU link
        return _from_links(name, n, _DGX1_LINKS, NVLINK2_GBPS * GB, 0.0, memory_bytes, host)
    if name == "pcie8":
        return _from_links(name, n, {}, 0.0, PCIE3_GBPS * GB / 2, memory_bytes, host)
    if name == "cpu":  # ranks on this host: gloo over loopback, a memcpy to "host" memory
        topo = _from_links(name, n, {}, 0.0, CPU_LOOPBACK_GBPS * GB, memory_bytes,
                           CPU_COPY_GBPS * GB)
        topo.kind = "cpu"
        return topo
    raise ConfigError(f"unknown topology preset {name!r}; choose one of {sorted(PRESETS)} or "
                      f"give a topology JSON file")


PRESETS = ("nvswitch8", "dgx1", "pcie8", "cpu")


def cluster(base: DeviceTopology, nodes: int, inter_node_bandwidth: float) -> DeviceTopology:
    """``nodes`` copies of ``base`` joined by a network (only the per-node table is stored;
    the planner uses the node for peer swap, which stays inside a node)."""
    return DeviceTopology(f"{nodes}x{base.name}", base.memory, base.bandwidth,
                          base.host_bandwidth, node_size=base.n,
                          inter_node_bandwidth=inter_node_bandwidth, labels=base.labels,
                          kind=base.kind)


_NV = re.compile(r"^NV(\d+)$")


def parse_nvidia_smi_topo(text: str, memory_bytes: int,
                          per_link: float = NVLINK2_GBPS * GB,
                          pcie: float = PCIE3_GBPS * GB) -> DeviceTopology:
    """Build a topology from the matrix ``nvidia-smi topo -m`` prints.

    ``NV#`` gives ``# * per_link`` bytes/s; PCIe paths (PIX, PXB, PHB, NODE, SYS) give
    ``pcie`` for PIX/PXB (same switch) and ``pcie / 2`` for paths through the CPU.

    Raises:
        ConfigError: no GPU rows found.
    """
    rows = [c for c in (ln.split() for ln in text.splitlines())  # the header has no "X"
            if c and re.fullmatch(r"GPU\d+", c[0]) and "X" in c]
    if not rows:
        raise ConfigError("no GPU rows in the `nvidia-smi topo -m` output; is a GPU visible?")
    n = len(rows)
    bw = [[0.0] * n for _ in range(n)]
    for i, cells in enumerate(rows):
        for j, cell in enumerate(cells[1 : n + 1]):
            if i == j:
                continue
            m = _NV.match(cell)
            if m:
                bw[i][j] = int(m.group(1)) * per_link
            elif cell in ("PIX", "PXB"):
                bw[i][j] = pcie
            else:
                bw[i][j] = pcie / 2
    return DeviceTopology("nvidia-smi", [memory_bytes] * n, bw, [pcie] * n,
                          labels=[r[0] for r in rows])
