"""The parts a :class:`~trainwright.run.trainer.Trainer` is built from, one function each.

``Trainer.__init__`` calls them in order and reads top to bottom; each takes what it
needs and returns what it builds (nothing here keeps state). :class:`TrainerOptions` is
what a caller may supply instead of the configuration's defaults (a ring node's exchange,
a benchmark's layers and data, a test's mesh).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwright.config import Config
from trainwright.dist.comm import P2P, Watchdog
from trainwright.dist.faults import FaultPoint
from trainwright.dist.topology import Topology
from trainwright.errors import PeerLost
from trainwright.model.build import split_microbatches
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.observe.telemetry import atomic_write_text
from trainwright.pipeline.budget import (
    MemoryBudget,
    measure_host_bandwidth,
    resolve_limit,
    stage_in_flight,
)
from trainwright.pipeline.interleaved import InterleavedRuntime
from trainwright.pipeline.peer_setup import agree_plan, runtime_policies
from trainwright.pipeline.peerswap import PeerSwap
from trainwright.pipeline.profile import profile_model
from trainwright.pipeline.runtime import PipelineRuntime, Runtime, StepHooks
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.tied import owned_parameters
from trainwright.run import checkpoint
from trainwright.sync import GradSync

__all__ = ["NamedLayers", "TrainerOptions", "P2PFactory", "make_runtime", "place_layers",
           "resumed_partition", "plan_peer_swap", "memory_budget", "load_resumed"]

log = logging.getLogger(__name__)

NamedLayers = list[tuple[str, torch.nn.Module]]


@dataclass(kw_only=True)
class TrainerOptions:
    """What a caller may give a :class:`~trainwright.run.trainer.Trainer` instead of the
    configuration's defaults."""

    mesh: Topology | None = None
    """This rank's place in the ``pp x dp`` mesh (default: create the groups)."""
    layers: Callable[[], NamedLayers] | None = None
    """Builds the whole model as ``(name, layer)`` pairs, the same on every call (default:
    from the config). Called again for profiling copies."""
    data: object = None
    """An object with ``batch(step, batch_size) -> (x, y)`` (default: from the config)."""
    grad_sync: GradSync | None = None
    """The gradient exchange (default: ``sync.strategy`` of the config)."""
    shard: tuple[int, int] | None = None
    """``(index, count)``: which share of each global batch this rank's replica trains on
    (default: its data-parallel index and ``dp``)."""
    peer_plan: dict | None = None
    """A peer-swap plan to run (default: planned here when ``memory.peer_swap``)."""
    peer_group: object = None
    """The group the peer-swap chunks travel on (default: a new one)."""
    profiler: LayerProfiler | None = None
    """The per-layer cost table (default: smoothed over steps)."""
    outputs: bool = True
    """Write metrics, trace, report and checkpoints (a token-ring node writes its own)."""
    watchdog: Watchdog | None = None
    """Names a lost peer when a transfer fails (None: report the failure only)."""
    fault_rank: int | None = None
    """This process's rank for the ``[fault]`` injection of tests."""


def place_layers(named: NamedLayers, parts: list[int], stages: list[int],
                 device: torch.device, make_optimizer) -> list[LayerSlot]:
    """This rank's layers (of model stages ``stages`` under partition ``parts``), moved to
    ``device``, each with its own optimizer over the parameters no earlier layer of the rank
    holds (a weight shared by two of its layers is stepped once)."""
    slots, seen = [], set()
    for k in stages:
        first = sum(parts[:k])
        for i in range(first, first + parts[k]):
            name, module = named[i]
            module.to(device)
            slots.append(LayerSlot(i, name, module,
                                   make_optimizer(owned_parameters(module, seen))))
    return slots


class P2PFactory:
    """Point-to-point transfers on a group of this rank's, every one naming a lost peer when
    the heartbeat watchdog knows it (``watchdog`` None: the failure alone is reported)."""

    def __init__(self, topo: Topology, runtime_cfg, device: torch.device,
                 watchdog: Watchdog | None):
        self.topo, self.cfg, self.device, self.watchdog = topo, runtime_cfg, device, watchdog

    def __call__(self, group) -> P2P:
        topo = self.topo
        return P2P(group, topo.rank, self.cfg.p2p_timeout_s, self.device, topo.describe,
                   on_failure=self._peer_lost)

    def _peer_lost(self, exc: Exception) -> PeerLost | None:
        """Which peer's loss caused ``exc``, when the watchdog knows."""
        if self.watchdog is None:
            return None
        verdict = self.watchdog.verdict(2 * self.cfg.peer_timeout_s)
        return None if verdict is None else PeerLost(verdict[0], verdict[1])


def make_runtime(stage: Stage, chunks: dict[int, Stage] | None, actions: list, p2p: P2P,
                 topo: Topology, stage_ranks: list[int], hooks: StepHooks,
                 fault: FaultPoint | None, peer: PeerSwap | None) -> Runtime:
    """The executor of this rank's actions: the interleaved one with several chunks, else
    the one-stage runtime talking to its two neighbours (with the peer swap's actions)."""
    s = topo.stage
    if chunks is not None:
        return InterleavedRuntime(stage, chunks, actions, p2p, hooks,
                                  rank_of=lambda k: topo.rank_of(stage_ranks[k]),
                                  replica=topo.replica, rank=s, fault=fault)
    return PipelineRuntime(
        stage, actions, p2p, hooks,
        prev_rank=topo.rank_of(s - 1) if s > 0 else None,
        next_rank=topo.rank_of(s + 1) if s < topo.pp - 1 else None,
        replica=topo.replica, fault=fault,
        extensions=peer.extensions() if peer is not None else None,
        after=peer.after if peer is not None else None)


def resumed_partition(run_dir: Path, step: int | None, n_stages: int, n_layers: int,
                      topo: Topology) -> list[int] | None:
    """The partition the resumed run had reached (a migration may have moved layers),
    when it ran with as many stages as this one."""
    if step is None:
        return None
    meta = checkpoint.read_meta(run_dir, step)
    parts = meta.get("partition")
    if parts and len(parts) == n_stages and sum(parts) == n_layers:
        return list(parts)
    if parts:
        log.info("checkpoint of step %d was written at pp=%s x dp=%s; this run has "
                 "pp=%d x dp=%d: layers re-partitioned as configured", step,
                 meta.get("pp"), meta.get("dp"), topo.pp, topo.dp)
    return None


def plan_peer_swap(cfg: Config, named: NamedLayers, parts: list[int], topo: Topology,
                   device: torch.device, data, replicas: int, write_to: Path | None) -> dict:
    """The job's peer-swap plan, the same on every rank (``write_to``: rank 0 writes it
    there as ``peer_plan.json``)."""
    t = cfg.train
    per_replica = t.batch_size // replicas
    x, y = data.batch(1, t.batch_size)
    sample = (split_microbatches(x[:per_replica], t.micro_batches)[0],
              split_microbatches(y[:per_replica], t.micro_batches)[0])
    limits = [resolve_limit(v, cfg, device) for v in cfg.stage_limits()]
    plan = agree_plan(cfg, named, parts, limits, topo, device, sample)
    if write_to is not None:
        atomic_write_text(write_to / "peer_plan.json", json.dumps(plan, indent=1) + "\n")
    return plan


def memory_budget(cfg: Config, stage: Stage, stage_index: int, device: torch.device,
                  n_layers: int, peer_plan: dict | None, chunk_layers,
                  build_layers: Callable[[], NamedLayers]) -> MemoryBudget:
    """The stage's memory budget, planned before step 1 when a limit is set (a peer-swap
    plan fixes every layer's policy instead)."""
    limit = resolve_limit(cfg.stage_limits()[stage_index], cfg, device)
    fixed = cfg.layer_policies(n_layers)
    if peer_plan is not None:
        planned = runtime_policies(peer_plan)
        fixed = {i: planned.get(i, "keep") for i in range(n_layers)}
    bandwidth = cfg.memory.host_bandwidth
    if not bandwidth and limit is not None and fixed is None:
        bandwidth = measure_host_bandwidth(device)
    budget = MemoryBudget(stage, stage_in_flight(cfg)[stage_index], limit, cfg.memory.planner,
                          bandwidth, fixed, chunks=chunk_layers)
    if limit is not None and fixed is None:
        budget.replan(costs=profile_model(cfg, build_layers(), device, stage.options),
                      why="before step 1")
    return budget


def load_resumed(run_dir: Path, step: int, slots: list[LayerSlot], objects: dict,
                 topo: Topology, rebalancer) -> None:
    """Parameters, optimizer state (every layer's, sharded ones included), registered
    objects, RNG states and any re-partition still under way, from the checkpoint of
    ``step``."""
    missing = checkpoint.load_state(run_dir, step, slots, objects=objects, rank=topo.rank,
                                    mesh=(topo.pp, topo.dp, topo.order))
    target = checkpoint.read_meta(run_dir, step).get("rebalance_target")
    if rebalancer is not None and target and len(target) == topo.pp:
        rebalancer.set_target(target, "resumed while re-partitioning")
    if missing and topo.rank == 0:
        log.info("resumed step %d without: %s (%s)", step, ", ".join(missing),
                 "another pp x dp" if "rng" in missing else "not in the checkpoint")
    log.info("resumed from the checkpoint of step %d", step)
