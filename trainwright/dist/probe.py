"""Measure the devices this job runs on: ``nvidia-smi`` topology and point-to-point links.

The pure descriptions (:class:`~trainwright.plan.devices.DeviceTopology`, presets, the
``nvidia-smi topo -m`` parser) live in :mod:`trainwright.plan.devices`; this module runs
the commands and the transfers that fill them in.
"""

from __future__ import annotations

from trainwright.plan.devices import DeviceTopology, parse_nvidia_smi_topo

__all__ = ["from_nvidia_smi", "measure_p2p"]


def from_nvidia_smi() -> DeviceTopology:  # pragma: no cover - needs a GPU
    """The local GPUs' topology via ``nvidia-smi topo -m`` and their memory via torch."""
    import subprocess

    import torch

    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    mem = torch.cuda.get_device_properties(0).total_memory
    return parse_nvidia_smi_topo(out, mem)


def measure_p2p(nbytes: int = 4 * 2**20, repeats: int = 3, memory_bytes: int = 0,
                group=None) -> DeviceTopology:
    """Time a send/recv between every ordered pair of ranks of ``group``; every rank calls.

    Pairs take turns (one pair at a time, the others wait at a barrier), so the figure is
    the bandwidth of one link alone. Best of ``repeats``.

    Returns:
        The same measured topology on every rank (host bandwidth: a local copy).
    """
    import time

    import torch
    import torch.distributed as dist
    from trainwright.dist import collective as coll

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = coll.backend_device(group) or torch.device("cpu")
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
    row = torch.zeros(world, dtype=torch.float64)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            coll.barrier(group)
            if rank not in (src, dst):
                continue
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                if rank == src:
                    coll.send(buf, glob(dst), group=group)
                    coll.recv(buf[:1], glob(dst), group=group)  # ack: the payload has landed
                else:
                    coll.recv(buf, glob(src), group=group)
                    coll.send(buf[:1], glob(src), group=group)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                best = min(best, time.perf_counter() - t0)
            if rank == src:
                row[dst] = nbytes / best
    table = [torch.zeros(world, dtype=torch.float64) for _ in range(world)]
    coll.all_gather(table, row, group=group)
    t0 = time.perf_counter()
    buf.clone()
    host = nbytes / max(time.perf_counter() - t0, 1e-9)
    hosts = torch.zeros(world, dtype=torch.float64)
    hosts[rank] = host
    coll.all_reduce(hosts, group=group)
    return DeviceTopology("measured", [memory_bytes] * world, [t.tolist() for t in table],
                          hosts.tolist())
