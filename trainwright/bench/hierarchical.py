"""``trainwright bench hierarchical``: seed 003's sync against flat all-reduce and FSDP2 HSDP.

The benchmark builds its own two-tier network (:mod:`trainwright.bench.netns`: one network
namespace per rank, 2 nodes x 2 ranks, 1 Gbit/s between nodes, unshaped inside a node),
starts one process per rank inside its namespace (gloo bound to ``eth0`` with
``GLOO_SOCKET_IFNAME``), and in one run, interleaved over ``repeats`` rounds, times:

- ``trainwright_hierarchical``: :class:`~trainwright.sync.hierarchical.HierarchicalSync`
  (P2P reduce-scatter pipelined with the inter-node all-reduce, sharded AdamW, all-gather);
- ``trainwright_hierarchical_reduce``: the same with ``dist.reduce`` per slice inside the node
  (the alternative implementation of the uneven reduce-scatter);
- ``flat_all_reduce``: the project's dense baseline (bucketed all-reduce over all 4 ranks,
  full AdamW on every rank);
- ``torch_fsdp2_hsdp``: ``fully_shard`` per layer on a 2-D ``(replicate, shard)`` CPU mesh;
  its communication happens inside forward/backward, so its ``sync_s`` is its forward +
  backward time minus a plain local forward + backward measured in the same round;
- ``trainwright_hierarchical_unequal``: ours with one rank given half the memory.

The workload is a 50M-parameter fp32 model (12 bias-free 2048 x 2048 linear layers) on a
tiny batch, so the step is dominated by gradient traffic. ``sync_s`` per step is the slowest
rank's; figures are medians over steps and rounds. ``inter_node_bytes_per_rank`` comes from
each rank's tc counter of the inter-node class (not measured on ``--loopback``).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainwright.bench.netns import (
    NetnsUnavailable,
    TwoTierNetwork,
    emulated,
    inter_node_bytes,
    run_ranks,
)
from trainwright.dist import collective as coll
from trainwright.errors import ConfigError

__all__ = ["HierBenchSpec", "run", "main", "SYSTEMS"]

SYSTEMS = ("trainwright_hierarchical", "trainwright_hierarchical_reduce", "flat_all_reduce",
           "torch_fsdp2_hsdp", "trainwright_hierarchical_unequal", "local_compute")


@dataclass
class HierBenchSpec:
    """The benchmark's workload and network."""

    nodes: int = 2
    ranks_per_node: int = 2
    width: int = 2048
    layers: int = 12
    """12 x 2048 x 2048 = 50.3M parameters."""
    batch: int = 4
    steps: int = 3
    """Timed steps per system per round (after one warm-up step)."""
    repeats: int = 3
    inter_rate: str = "1gbit"
    mtu: int = 1500
    chunks: int = 4
    network: str = "netns"
    """``"netns"`` (the emulated two-tier network) or ``"loopback"`` (127.0.0.1, no shaping)."""
    timeout_s: float = 1800.0
    lr: float = 1e-3

    @property
    def world(self) -> int:
        """Ranks."""
        return self.nodes * self.ranks_per_node

    @property
    def numel(self) -> int:
        """Parameters of the model."""
        return self.layers * self.width * self.width


# ----------------------------------------------------------------------------- worker side

def _model(spec: HierBenchSpec) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(spec.width, spec.width, bias=False)
                           for _ in range(spec.layers)))


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.numel() * t.element_size()
    return total


def _fwd_bwd(model, x) -> None:
    model(x).square().mean().backward()


def _run_system(system: str, spec: HierBenchSpec, rank: int, x: torch.Tensor) -> dict:
    """Warm-up step, then ``spec.steps`` timed steps of ``system``; this rank's figures."""
    from trainwright.config import HierarchicalConfig
    from trainwright.sync.dense import BucketedAllReduce
    from trainwright.sync.hierarchical import HierarchicalDataParallel

    model = _model(spec)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=spec.lr)
    out: dict = {"system": system, "rank": rank, "sync_s": [], "step_s": [], "compute_s": []}
    hdp = opt = flat = None
    if system.startswith("trainwright_hierarchical"):
        weights, mem = "equal", ""
        if system.endswith("unequal"):  # the last rank has half the memory of the others
            weights, mem = "memory", ("4GiB" if rank == spec.world - 1 else "8GiB")
        cfg = HierarchicalConfig(ranks_per_node=spec.ranks_per_node, weights=weights,
                                 available_memory=mem, chunks=spec.chunks)
        hdp = HierarchicalDataParallel(model, adamw, cfg, timeout_s=spec.timeout_s,
                                       intra="reduce" if system.endswith("reduce") else "p2p")
    elif system == "flat_all_reduce":
        flat = BucketedAllReduce(None, spec.world)
        opt = adamw(list(model.parameters()))
    elif system == "torch_fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (spec.nodes, spec.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw(list(model.parameters()))
    before = None
    for step in range(spec.steps + 1):
        if step == 1:
            coll.barrier()
            before = inter_node_bytes()
        coll.barrier()
        t0 = time.perf_counter()
        _fwd_bwd(hdp if hdp is not None else model, x)
        t1 = time.perf_counter()
        sync_s = None
        if hdp is not None:
            hdp.sync()
            t2 = time.perf_counter()
            hdp.step()
            sync_s = (t2 - t1) + hdp.hsync.timings["all_gather_s"]
        elif flat is not None:
            flat.sync(list(model.parameters()))
            sync_s = time.perf_counter() - t1
            opt.step()
            opt.zero_grad(set_to_none=False)
        elif opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=False)
        else:
            model.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        if step >= 1:
            out["sync_s"].append(sync_s)
            out["step_s"].append(t3 - t0)
            out["compute_s"].append(t1 - t0)
    coll.barrier()
    after = inter_node_bytes()
    out["inter_node_bytes"] = None if before is None or after is None else \
        (after - before) / spec.steps
    if hdp is not None:
        hs = hdp.hsync
        lo, hi = hs.owned
        out.update(optimizer_state_bytes=hs.optimizer_state_bytes(), shard_numel=hi - lo,
                   shard_bytes=(hi - lo) * 4, weights=hs.weights, local=hs.groups.local,
                   node=hs.groups.node)
    elif opt is not None:
        out["optimizer_state_bytes"] = _state_bytes(opt)
    del model, hdp, opt, flat
    gc.collect()
    return out


def worker(tmp: str, rank: int) -> None:
    """One rank of the benchmark (run inside its namespace by :func:`run`)."""
    spec = HierBenchSpec(**json.loads((Path(tmp) / "spec.json").read_text()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    x = torch.randn(spec.batch, spec.width, generator=torch.Generator().manual_seed(rank))
    rows, done = [], 0
    total = spec.repeats * len(SYSTEMS)
    for rep in range(spec.repeats):
        order = list(SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[: rep % len(SYSTEMS)])
        for system in order:
            mine = _run_system(system, spec, rank, x)
            mine["round"] = rep
            gathered: list | None = [None] * spec.world if rank == 0 else None
            coll.gather_object(mine, gathered, dst=0)
            done += 1
            if rank == 0:
                rows += gathered
                (Path(tmp) / "progress").write_text(f"{done} {total}")
    if rank == 0:
        tmp_out = Path(tmp) / ".result.json.tmp"
        tmp_out.write_text(json.dumps(rows))
        os.replace(tmp_out, Path(tmp) / "result.json")
    coll.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver side

def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(rows: list[dict], spec: HierBenchSpec) -> dict:
    """Per-system figures from every rank's rows: slowest rank per step, medians."""
    def per_step_max(system: str, key: str) -> list[float]:
        out = []
        for rnd in range(spec.repeats):
            ranks = [r for r in rows if r["system"] == system and r["round"] == rnd]
            for i in range(spec.steps):
                vals = [r[key][i] for r in ranks if r[key][i] is not None]
                if vals:
                    out.append(max(vals))
        return out

    local = _median(per_step_max("local_compute", "compute_s"))
    table = {}
    for system in SYSTEMS:
        if system == "local_compute":
            continue
        mine = sorted((r for r in rows if r["system"] == system and r["round"] == 0),
                      key=lambda r: r["rank"])
        if system == "torch_fsdp2_hsdp":  # its traffic is inside forward + backward
            sync = [c - local for c in per_step_max(system, "compute_s")]
        else:
            sync = per_step_max(system, "sync_s")
        row = {"system": system, "sync_s": _median(sync), "step_s": _median(
            per_step_max(system, "step_s")), "sync_s_all": [round(s, 4) for s in sync],
            "inter_node_bytes_per_rank": [r["inter_node_bytes"] for r in mine],
            "optimizer_state_bytes_per_rank": [r.get("optimizer_state_bytes") for r in mine]}
        if system == "torch_fsdp2_hsdp":
            row["sync_s_method"] = ("forward+backward time minus a plain local forward+backward "
                                    f"({local:.4f} s) in the same rounds")
        if system.startswith("trainwright_hierarchical"):
            row["shards"] = [{k: r[k] for k in ("rank", "node", "local", "weights",
                                                "shard_numel", "shard_bytes",
                                                "optimizer_state_bytes")} for r in mine]
        table[system] = row
    return table


def run(spec: HierBenchSpec) -> dict:
    """Build the network (unless ``spec.network == "loopback"``), run every system, and
    remove the network again, also on failure or Ctrl-C / SIGTERM."""
    if spec.network not in ("netns", "loopback"):
        raise ConfigError(f"network = {spec.network!r}; choose 'netns' or 'loopback'")
    net = (TwoTierNetwork(spec.nodes, spec.ranks_per_node, spec.inter_rate, spec.mtu)
           if spec.network == "netns" else None)
    with tempfile.TemporaryDirectory(prefix="tw-bench-hier-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(asdict(spec)))
        with emulated(net):
            run_ranks("trainwright.bench.hierarchical", tmp, spec.world, net,
                      timeout_s=spec.timeout_s, total=spec.repeats * len(SYSTEMS),
                      label="bench hierarchical",
                      env_for=lambda r: {"TRAINWRIGHT_HOST": f"node{r // spec.ranks_per_node}"})
        rows = json.loads((Path(tmp) / "result.json").read_text())
    return _report(rows, spec)


def _report(rows: list[dict], spec: HierBenchSpec) -> dict:
    table = summarise(rows, spec)
    ours, flat = table["trainwright_hierarchical"], table["flat_all_reduce"]
    rate = _rate_bits(spec.inter_rate)
    grad = spec.numel * 4
    out = {
        "benchmark": "hierarchical",
        "network": (f"{spec.nodes} nodes x {spec.ranks_per_node} ranks, network namespaces, "
                    f"{spec.inter_rate} per rank between nodes (tc htb), unshaped inside a node"
                    if spec.network == "netns" else "loopback 127.0.0.1, no shaping"),
        "gradient_numel": spec.numel, "gradient_bytes": grad,
        "ratio_vs_flat": ours["sync_s"] / flat["sync_s"],
        "target_ratio_vs_flat": 0.5,
        "step_ratio_vs_flat": ours["step_s"] / flat["step_s"],
        "ratio_reduce_variant_vs_flat": (table["trainwright_hierarchical_reduce"]["sync_s"]
                                         / flat["sync_s"]),
        "fsdp2_hsdp_on_gloo": "runs (torch FSDP2 fully_shard on a (replicate, shard) CPU mesh)",
        "bound_hierarchical_s": grad / spec.ranks_per_node * 8 / rate if rate else None,
        "bound_flat_ring_s": 1.5 * grad * 8 / rate if rate else None,
        "rows": [table[s] for s in ("trainwright_hierarchical", "flat_all_reduce",
                                    "torch_fsdp2_hsdp", "trainwright_hierarchical_reduce")],
        "unequal_weights": table["trainwright_hierarchical_unequal"],
        "spec": asdict(spec), "torch": torch.__version__,
    }
    if spec.network == "loopback":
        out["bound_hierarchical_s"] = out["bound_flat_ring_s"] = None
    return out


def _rate_bits(rate: str) -> float | None:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    return None


def main(args) -> dict:
    """CLI entry: ``trainwright bench hierarchical [--loopback] [--repeats N] [--steps N]``."""
    spec = HierBenchSpec(repeats=args.repeats or 3, steps=args.steps or 3,
                         network="loopback" if getattr(args, "loopback", False) else "netns")
    try:
        return run(spec)
    except NetnsUnavailable as exc:
        raise ConfigError(str(exc)) from None


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: python -m trainwright.bench.hierarchical --worker TMPDIR RANK "
                 "(started by `trainwright bench hierarchical`)")
