"""``trainwright bench hierarchical``: hierarchical sync end to end, against torch DDP and FSDP2.

The question: on 2 nodes x 2 ranks joined by a 1 Gbit/s link, how long does a whole
training step (forward + backward + gradient sync + optimizer) take with our hierarchical
sync, against what a user would run instead?

The benchmark builds its own two-tier network (:mod:`trainwright.bench.netns`: one network
namespace per rank, 2 nodes x 2 ranks, 1 Gbit/s between nodes, unshaped inside a node),
starts one process per rank inside its namespace (gloo bound to ``eth0`` with
``GLOO_SOCKET_IFNAME``), and times, in ``repeats`` rounds with the systems in ABBA order
(:func:`~trainwright.bench.paired.round_order`):

- ``trainwright_hierarchical``: :class:`~trainwright.sync.hierarchical.HierarchicalSync`
  (P2P reduce-scatter pipelined with the inter-node all-reduce, sharded AdamW, all-gather);
- ``torch_ddp``: ``DistributedDataParallel`` over gloo with its own buckets and its overlap
  of the all-reduce with backward, full AdamW on every rank;
- ``torch_ddp_zero``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (AdamW state sharded over all ranks): the peer a user picks against a sharded optimizer;
- ``torch_fsdp2_hsdp``: ``fully_shard`` per layer on a 2-D ``(replicate, shard)`` CPU mesh
  with ``reshard_after_forward=False`` (no re-gather in backward);
- optional (``spec.systems``): ``flat_all_reduce`` (the project's bucketed all-reduce),
  ``trainwright_hierarchical_reduce`` and ``trainwright_hierarchical_unequal``.

The workload is fp32 bias-free 2048 x 2048 linear layers on a tiny batch, so the step is
dominated by gradient traffic. A step's time is the slowest rank's; a round's figure is the
median over its ``steps`` steps (after one warm-up step); ``ratio_vs_ddp`` is the median over
rounds of the paired per-round ratio. ``cross_node_bytes_per_step`` is read from the kernel,
not from our own accounting: the tc byte counter of each rank's inter-node HTB class, summed
over the ranks (and, beside it, every rank's ``eth0`` ``tx_bytes``).
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
    interface_bytes,
    run_ranks,
)
from trainwright.dist import collective as coll
from trainwright.errors import ConfigError

__all__ = ["HierBenchSpec", "run", "main", "SYSTEMS", "ALL_SYSTEMS"]

ALL_SYSTEMS = ("trainwright_hierarchical", "torch_ddp", "torch_ddp_zero", "torch_fsdp2_hsdp",
               "flat_all_reduce", "trainwright_hierarchical_reduce",
               "trainwright_hierarchical_unequal")
SYSTEMS = ALL_SYSTEMS[:4]
"""Measured by default: ours and the peers a user would run against a sharded optimizer."""


@dataclass
class HierBenchSpec:
    """The benchmark's workload and network."""

    nodes: int = 2
    ranks_per_node: int = 2
    width: int = 2048
    layers: int = 2
    """2 x 2048 x 2048 = 8.4M parameters (12 layers until the paired rounds: 3 systems x
    5 rounds x 16 steps of the 50M model took over an hour on the shared 2-core machine)."""
    batch: int = 4
    steps: int = 15
    """Timed steps per system per round (after one warm-up step)."""
    repeats: int = 5
    """Rounds; systems in ABBA order within each."""
    systems: tuple = SYSTEMS
    """Systems to measure (``ALL_SYSTEMS`` names them all); must include ours and DDP."""
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


def _build(system: str, spec: HierBenchSpec, rank: int, model: nn.Module):
    """``(module to call, step function)`` of ``system`` around ``model``."""
    from trainwright.config import HierarchicalConfig
    from trainwright.sync.dense import BucketedAllReduce
    from trainwright.sync.hierarchical import HierarchicalDataParallel

    adamw = lambda ps: torch.optim.AdamW(ps, lr=spec.lr)
    if system.startswith("trainwright_hierarchical"):
        weights, mem = "equal", ""
        if system.endswith("unequal"):  # the last rank has half the memory of the others
            weights, mem = "memory", ("4GiB" if rank == spec.world - 1 else "8GiB")
        cfg = HierarchicalConfig(ranks_per_node=spec.ranks_per_node, weights=weights,
                                 available_memory=mem, chunks=spec.chunks)
        hdp = HierarchicalDataParallel(model, adamw, cfg, timeout_s=spec.timeout_s,
                                       intra="reduce" if system.endswith("reduce") else "p2p")
        return hdp, lambda: (hdp.sync(), hdp.step()), hdp
    if system == "flat_all_reduce":
        flat, opt = BucketedAllReduce(None, spec.world), adamw(list(model.parameters()))
        return model, lambda: (flat.sync(list(model.parameters())), opt.step(),
                               opt.zero_grad(set_to_none=False)), opt
    if system == "torch_ddp":  # gloo, torch's own buckets and overlap with backward
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = adamw(list(ddp.parameters()))
        return ddp, lambda: (opt.step(), opt.zero_grad(set_to_none=False)), opt
    if system == "torch_ddp_zero":  # DDP's all-reduce, AdamW state sharded over all ranks
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(list(ddp.parameters()),
                                      optimizer_class=torch.optim.AdamW, lr=spec.lr)
        return ddp, lambda: (opt.step(), opt.zero_grad(set_to_none=False)), opt.optim
    if system == "torch_fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (spec.nodes, spec.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
        for layer in model:  # parameters stay gathered between forward and backward
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        opt = adamw(list(model.parameters()))
        return model, lambda: (opt.step(), opt.zero_grad(set_to_none=False)), opt
    raise ValueError(f"unknown system {system!r}; choose one of {ALL_SYSTEMS}")


def _run_system(system: str, spec: HierBenchSpec, rank: int, x: torch.Tensor) -> dict:
    """Warm-up step, then ``spec.steps`` timed end-to-end steps (forward, backward, sync,
    optimizer) of ``system``; this rank's figures and kernel byte counters."""
    model = _model(spec)
    module, finish, owner = _build(system, spec, rank, model)
    out: dict = {"system": system, "rank": rank, "step_s": [], "compute_s": []}
    before = None
    for step in range(spec.steps + 1):
        if step == 1:
            coll.barrier()
            before = (inter_node_bytes(), interface_bytes())
        coll.barrier()
        t0 = time.perf_counter()
        _fwd_bwd(module, x)
        t1 = time.perf_counter()
        finish()
        t2 = time.perf_counter()
        if step >= 1:
            out["step_s"].append(t2 - t0)
            out["compute_s"].append(t1 - t0)
    coll.barrier()
    after = (inter_node_bytes(), interface_bytes())
    out["inter_node_bytes"] = None if None in (before[0], after[0]) else \
        (after[0] - before[0]) / spec.steps
    out["eth0_tx_bytes"] = None if None in (before[1], after[1]) else \
        (after[1] - before[1]) / spec.steps
    if system.startswith("trainwright_hierarchical"):
        hs = owner.hsync
        lo, hi = hs.owned
        out.update(optimizer_state_bytes=hs.optimizer_state_bytes(), shard_numel=hi - lo,
                   shard_bytes=(hi - lo) * 4, weights=hs.weights, local=hs.groups.local,
                   node=hs.groups.node)
    else:
        out["optimizer_state_bytes"] = _state_bytes(owner)
    del model, module, finish, owner
    gc.collect()
    return out


def worker(tmp: str, rank: int) -> None:
    """One rank of the benchmark (run inside its namespace by :func:`run`)."""
    from trainwright.bench.paired import round_order

    spec = HierBenchSpec(**json.loads((Path(tmp) / "spec.json").read_text()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    x = torch.randn(spec.batch, spec.width, generator=torch.Generator().manual_seed(rank))
    rows, done = [], 0
    total = spec.repeats * len(spec.systems)
    for rep in range(spec.repeats):
        for system in round_order(spec.systems, rep):
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

def round_step_s(rows: list[dict], system: str, rnd: int, key: str = "step_s") -> float:
    """One round's figure of ``system``: the median over steps of the slowest rank's time."""
    ranks = [r for r in rows if r["system"] == system and r["round"] == rnd]
    return statistics.median(max(r[key][i] for r in ranks) for i in range(len(ranks[0][key])))


def _per_step_total(rows: list[dict], system: str, key: str) -> float | None:
    """Median over rounds of the bytes all ranks together counted per step (None: no counter)."""
    per_round = []
    for rnd in sorted({r["round"] for r in rows}):
        vals = [r[key] for r in rows if r["system"] == system and r["round"] == rnd]
        if any(v is None for v in vals):
            return None
        per_round.append(sum(vals))
    return statistics.median(per_round)


def summarise(rows: list[dict], spec: HierBenchSpec) -> dict:
    """Per-system figures from every rank's rows: per round, the median over steps of the
    slowest rank's step; per system, the median over rounds."""
    table = {}
    for system in spec.systems:
        rounds = [round_step_s(rows, system, k) for k in range(spec.repeats)]
        compute = [round_step_s(rows, system, k, "compute_s") for k in range(spec.repeats)]
        mine = sorted((r for r in rows if r["system"] == system and r["round"] == 0),
                      key=lambda r: r["rank"])
        row = {"system": system, "step_s": statistics.median(rounds),
               "step_s_rounds": [round(v, 4) for v in rounds],
               "fwd_bwd_s": statistics.median(compute),
               "cross_node_bytes_per_step": _per_step_total(rows, system, "inter_node_bytes"),
               "eth0_tx_bytes_per_step": _per_step_total(rows, system, "eth0_tx_bytes"),
               "inter_node_bytes_per_rank": [r["inter_node_bytes"] for r in mine],
               "optimizer_state_bytes_per_rank": [r.get("optimizer_state_bytes") for r in mine]}
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
    missing = [s for s in ("trainwright_hierarchical", "torch_ddp") if s not in spec.systems]
    bad = [s for s in spec.systems if s not in ALL_SYSTEMS]
    if missing or bad:
        raise ConfigError(f"systems = {list(spec.systems)}: " + (
            f"unknown {bad}; choose from {list(ALL_SYSTEMS)}" if bad
            else f"the headline needs {missing}"))
    net = (TwoTierNetwork(spec.nodes, spec.ranks_per_node, spec.inter_rate, spec.mtu)
           if spec.network == "netns" else None)
    with tempfile.TemporaryDirectory(prefix="tw-bench-hier-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(asdict(spec)))
        with emulated(net):
            run_ranks("trainwright.bench.hierarchical", tmp, spec.world, net,
                      timeout_s=spec.timeout_s, total=spec.repeats * len(spec.systems),
                      label="bench hierarchical",
                      env_for=lambda r: {"TRAINWRIGHT_HOST": f"node{r // spec.ranks_per_node}"})
        rows = json.loads((Path(tmp) / "result.json").read_text())
    return _report(rows, spec)


def _report(rows: list[dict], spec: HierBenchSpec) -> dict:
    from trainwright.bench.paired import host_info, judged, paired

    table = summarise(rows, spec)
    ours = table["trainwright_hierarchical"]["step_s_rounds"]
    rate = _rate_bits(spec.inter_rate)
    grad = spec.numel * 4
    out = {
        "benchmark": "hierarchical",
        "question": "end-to-end step time (forward + backward + sync + optimizer) of the same "
                    "model on 2 nodes x 2 ranks over a 1 Gbit/s inter-node link, against torch "
                    "DDP (gloo, its own buckets and overlap), DDP + ZeroRedundancyOptimizer "
                    "and FSDP2 HSDP "
                    "(reshard_after_forward=False)",
        "network": (f"{spec.nodes} nodes x {spec.ranks_per_node} ranks, network namespaces, "
                    f"{spec.inter_rate} per rank between nodes (tc htb), unshaped inside a node"
                    if spec.network == "netns" else "loopback 127.0.0.1, no shaping"),
        "gradient_numel": spec.numel, "gradient_bytes": grad,
        **paired(ours, table["torch_ddp"]["step_s_rounds"]),
    }
    out["ratio_vs_ddp"] = out["ratio"]
    out["target_ratio_vs_ddp"] = 0.6
    if "torch_fsdp2_hsdp" in table:
        fsdp = paired(ours, table["torch_fsdp2_hsdp"]["step_s_rounds"])
        out["ratio_vs_fsdp2_hsdp"], out["ratio_vs_fsdp2_hsdp_spread"] = (
            fsdp["ratio"], fsdp["ratio_spread"])
    out["cross_node_bytes_per_step"] = {s: r["cross_node_bytes_per_step"]
                                        for s, r in table.items()}
    out["cross_node_bytes_instrument"] = (
        "kernel tc counter of each rank's inter-node HTB class (tc -s class show dev eth0), "
        "summed over ranks; eth0_tx_bytes_per_step is /sys/class/net/eth0/statistics/tx_bytes "
        "(all traffic, intra-node included)" if spec.network == "netns" else
        "not measured on loopback")
    out["bound_hierarchical_s"] = grad / spec.ranks_per_node * 8 / rate if rate else None
    out["bound_flat_ring_s"] = 1.5 * grad * 8 / rate if rate else None
    if spec.network == "loopback":
        out["bound_hierarchical_s"] = out["bound_flat_ring_s"] = None
    if rate and spec.network == "netns":  # each system against the bound of its own traffic
        for row in table.values():
            per_rank = [b for b in row["inter_node_bytes_per_rank"] if b is not None]
            if per_rank:  # every rank's inter-node class is shaped to ``rate`` on its own
                row["link_bound_s"] = round(max(per_rank) * 8 / rate, 4)
                row["step_vs_link_bound"] = round(row["step_s"] / row["link_bound_s"], 3)
    out["ratio_vs_ddp_judged"] = judged(out["paired_ratios"], 0.6)
    if "torch_ddp_zero" in table:
        zero = paired(ours, table["torch_ddp_zero"]["step_s_rounds"])
        out["ratio_vs_ddp_zero"], out["ratio_vs_ddp_zero_judged"] = (
            zero["ratio"], judged(zero["paired_ratios"], 0.6))
    out["rows"] = [table[s] for s in spec.systems]
    out.update(spec=asdict(spec), host=host_info())
    return out


def _rate_bits(rate: str) -> float | None:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    return None


def main(args) -> dict:
    """CLI entry: ``trainwright bench hierarchical [--loopback] [--repeats N] [--steps N]``."""
    default = HierBenchSpec()
    spec = HierBenchSpec(repeats=args.repeats or default.repeats, steps=args.steps or default.steps,
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
