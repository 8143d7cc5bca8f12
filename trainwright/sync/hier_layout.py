"""Hierarchical sync's nodes and slices: which ranks form a node, their process groups, and how the
flat gradient is cut into one slice per local rank in proportion to free memory (and
optionally speed). :mod:`trainwright.sync.hierarchical` runs the sync over them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.config import HierarchicalConfig, parse_bytes
from trainwright.dist import collective as coll
from trainwright.errors import ConfigError

__all__ = ["NodeLayout", "HierGroups", "node_key", "node_layout", "create_groups", "host_names",
           "slice_bounds", "free_memory", "measure_speed", "agree_weights", "resolve_weights"]


# ----------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class NodeLayout:
    """The ranks of one sync group arranged as ``nodes x ranks_per_node``.

    ``order`` lists the group's global ranks node by node; position ``n * ranks_per_node +
    j`` is local rank ``j`` of node ``n``.
    """

    order: tuple[int, ...]
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(self.order) // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node index of global ``rank``."""
        return self.order.index(rank) // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        """Local index of global ``rank`` within its node."""
        return self.order.index(rank) % self.ranks_per_node

    def intra(self, node: int) -> list[int]:
        """Global ranks of ``node``, by local index."""
        k = self.ranks_per_node
        return list(self.order[node * k : (node + 1) * k])

    def inter(self, local: int) -> list[int]:
        """Global ranks with local index ``local``, one per node."""
        return list(self.order[local :: self.ranks_per_node])


def node_layout(members: Sequence[int], ranks_per_node: int = 0,
                hosts: Sequence[str] | None = None) -> NodeLayout:
    """Arrange the sync group ``members`` (global ranks) into nodes.

    Args:
        members: the group's global ranks.
        ranks_per_node: consecutive members per node; 0 = members on one host form a node.
        hosts: host name of every global rank (needed when ``ranks_per_node`` is 0).

    Raises:
        ConfigError: the members do not split into equal nodes.
    """
    members = list(members)
    if ranks_per_node > 0:
        if len(members) % ranks_per_node:
            raise ConfigError(f"hierarchical.ranks_per_node = {ranks_per_node} does not divide "
                              f"the {len(members)} ranks of the sync group; use a divisor of "
                              f"{len(members)}")
        return NodeLayout(tuple(members), ranks_per_node)
    if hosts is None:
        raise ValueError("node_layout needs the host names when ranks_per_node is 0")
    by_host: dict[str, list[int]] = {}
    for r in members:
        by_host.setdefault(hosts[r], []).append(r)
    sizes = {h: len(rs) for h, rs in by_host.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"hosts run different numbers of ranks of one sync group ({sizes}); "
                          f"hierarchical sync needs equal nodes: launch the same number of "
                          f"ranks per host or set hierarchical.ranks_per_node")
    return NodeLayout(tuple(r for rs in by_host.values() for r in rs), len(members) // len(by_host))


def node_key(environ=None) -> str:
    """What names this process's node: ``TRAINWRIGHT_HOST`` if set; under torchrun its
    agent's ``GROUP_RANK`` (torchrun's own node; hosts may share a host name, e.g. network
    namespaces or containers); else the host name."""
    e = os.environ if environ is None else environ
    if e.get("TRAINWRIGHT_HOST"):
        return e["TRAINWRIGHT_HOST"]
    if "GROUP_RANK" in e and "LOCAL_WORLD_SIZE" in e:
        return f"torchrun-node-{e['GROUP_RANK']}"
    return socket.gethostname()


def host_names() -> list[str]:
    """Node name (:func:`node_key`) of every rank of the default group (a collective)."""
    names: list = [None] * dist.get_world_size()
    coll.all_gather_object(names, node_key())
    return names


@dataclass
class HierGroups:
    """This rank's place in a :class:`NodeLayout` and its two process groups."""

    layout: NodeLayout
    rank: int
    intra_group: object = field(repr=False)
    """The ranks of this rank's node."""
    inter_group: object = field(repr=False)
    """The ranks with this rank's local index, one per node."""

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.layout.node_of(self.rank)

    @property
    def local(self) -> int:
        """This rank's local index."""
        return self.layout.local_of(self.rank)

    @property
    def intra_ranks(self) -> list[int]:
        """Global ranks of this node, by local index."""
        return self.layout.intra(self.node)


def create_groups(layouts: Sequence[NodeLayout], rank: int) -> HierGroups | None:
    """Create the intra- and inter-node groups of every layout; return this rank's.

    ``new_group`` is collective over the default group, so every rank of the job must call
    this with the same ``layouts`` (e.g. one per pipeline stage): groups are created in the
    same order everywhere.
    """
    mine = None
    for layout in layouts:
        intra = [dist.new_group(layout.intra(n)) for n in range(layout.nodes)]
        inter = [dist.new_group(layout.inter(j)) for j in range(layout.ranks_per_node)]
        if rank in layout.order:
            mine = HierGroups(layout, rank, intra[layout.node_of(rank)],
                              inter[layout.local_of(rank)])
    return mine


# ----------------------------------------------------------------------------- slices

def slice_bounds(numel: int, weights: Sequence[float], align: int) -> list[tuple[int, int]]:
    """Cut ``[0, numel)`` into one slice per weight, sizes in proportion to the weights.

    Each inner boundary is the ideal cumulative share rounded to the nearest multiple of
    ``align``, so every slice is within one ``align`` of its ideal size; the last slice ends
    exactly at ``numel``.
    """
    total = float(sum(weights))
    if not weights or any(w <= 0 for w in weights):
        raise ConfigError(f"slice weights {list(weights)} must all be positive")
    cuts, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(min(numel, max(cuts[-1], align * round(numel * acc / total / align))))
    cuts.append(numel)
    return [(cuts[j], cuts[j + 1]) for j in range(len(weights))]


def _pieces(lo: int, hi: int, chunks: int) -> list[tuple[int, int]]:
    n = hi - lo
    edges = [lo + (n * c) // chunks for c in range(chunks + 1)]
    return [(edges[c], edges[c + 1]) for c in range(chunks)]


def free_memory(device: torch.device, available: object = "", local: int = 0,
                local_ranks: int = 1) -> float:
    """Free memory of this rank's device in bytes.

    CUDA: ``torch.cuda.mem_get_info``. CPU: the configured ``available`` (a size, or a list
    indexed by local rank), else the host's MemAvailable shared by ``local_ranks``.
    """
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    if isinstance(available, list):
        if len(available) != local_ranks:
            raise ConfigError(f"hierarchical.available_memory has {len(available)} sizes but a "
                              f"node has {local_ranks} ranks; give one size per local rank")
        return float(parse_bytes(available[local]))
    if available not in ("", None):
        return float(parse_bytes(available))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024 / local_ranks
    return 1.0  # pragma: no cover - not Linux: equal slices


def measure_speed(device: torch.device, size: int = 256, repeats: int = 8) -> float:
    """This rank's matmul speed in FLOP/s (median of ``repeats`` timed products)."""
    a = torch.randn(size, size, device=device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / max(sorted(times)[len(times) // 2], 1e-9)


def agree_weights(groups: HierGroups, mine: float) -> list[float]:
    """Slice weights by local index, the same on every node: gather each node's values and
    take the smallest per local index over the nodes (a slice must fit on every node)."""
    k = groups.layout.ranks_per_node
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(k)]
    coll.all_gather(out, torch.tensor([mine], dtype=torch.float64), group=groups.intra_group)
    vec = torch.cat(out)
    if groups.layout.nodes > 1:
        coll.all_reduce(vec, op=dist.ReduceOp.MIN, group=groups.inter_group)
    return vec.tolist()


def resolve_weights(cfg: HierarchicalConfig, groups: HierGroups,
                    device: torch.device) -> list[float]:
    """The slice weights ``cfg.weights`` asks for (a collective over the sync group)."""
    k = groups.layout.ranks_per_node
    w = cfg.weights
    if isinstance(w, list):
        if len(w) != k:
            raise ConfigError(f"hierarchical.weights has {len(w)} values but a node has {k} "
                              f"ranks; give one weight per local rank")
        return [float(x) for x in w]
    if w == "equal":
        return [1.0] * k
    mine = free_memory(device, cfg.available_memory, groups.local, k)
    if w == "memory_speed":
        mine *= measure_speed(device)
    return agree_weights(groups, mine)
