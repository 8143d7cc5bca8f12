"""The peer-swap planner end to end: partition, device mapping, tensor policies, simulation.

:func:`make_plan` takes per-layer tensor profiles (:mod:`trainwright.observe.tensor_profile`, real
or meta), a schedule, a device topology and memory budgets, and returns a
:class:`PlanResult`:

1. **partition** the layers into ``pp`` stages (min-max forward+backward time,
   :func:`trainwright.plan.partition.minmax_partition`) unless one is given;
2. **budgets**: activation bytes per stage, given, or the device's memory minus
   ``state_factor * parameter bytes`` (parameters, gradients, optimizer state) minus a
   reserve;
3. **liveness**: replay the all-keep schedule (:func:`trainwright.plan.simulate.simulate`)
   and take each layer's shortest live interval;
4. **mapping**: stages ``[j * node_size, (j + 1) * node_size)`` run on node ``j`` (peer
   swap stays inside a node); inside each node, the stage-to-device mappings are ranked
   by :func:`trainwright.plan.placement.search_mappings` (symmetry pruned);
5. **placement** (:func:`trainwright.plan.placement.place`) for the best mappings, each
   **simulated** with its peer-swap actions; the best plan is the one where most stages
   fit, then the shortest simulated step;
6. **iterate**: with peer swap, also try the interval thresholds scaled by
   4, 16 and infinity (peers first) and keep the best simulated; then re-derive the live
   intervals from the chosen plan's replay, place again, simulate again; stop when the
   step time no longer improves.

With ``virtual_stages = v > 1`` (interleaved 1F1B, ZB-V) the model is cut into ``pp * v``
stages, placed on the ranks by the schedule
(:func:`~trainwright.schedule.actions.stage_ranks`); costs are per model stage (the
simulator replays each rank's list with its chunks' rows), budgets, in-flight counts
(per chunk: :class:`~trainwright.plan.memory.ChunkInFlight`) and placement per rank, and
peer swap is not planned.

With a :attr:`PlanRequest.calibration` (CPU ranks on one host) every simulation charges
the host's measured per-action, per-segment, send and receive overheads
(:func:`~trainwright.plan.calibration.with_overheads`; a stage's segments from its layers'
policies, :func:`~trainwright.plan.calibration.count_segments`), delays each message
between ranks by the measured delivery among the job's ranks (:func:`calibrated_links`)
and slows the ranks by the shared-core factor of all ranks computing at once, every
data-parallel replica's included (:attr:`PlanRequest.replicas`). The plan's ``costs``
carry the overheads; the slowdown is the replay's (``sim.slowdown``).

Pure: no torch (profiles are plain rows with ``forward_s, backward_s, input_bytes,
output_bytes, param_bytes, tensors``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from trainwright.errors import PlanError
from trainwright.plan.calibration import (
    Calibration,
    count_segments,
    with_delivery,
    with_overheads,
)
from trainwright.plan.devices import DeviceTopology
from trainwright.plan.memory import ChunkInFlight, InFlight
from trainwright.plan.partition import ClusterCost, minmax_partition
from trainwright.plan.placement import (
    FAMILIES,
    Placement,
    Rules,
    StageMem,
    place,
    search_mappings,
)
from trainwright.plan.sharing import Sharing
from trainwright.plan.simulate import Links, SimResult, StageCost, liveness, simulate
from trainwright.plan.stage_inputs import placement_policies, stage_costs, stage_mems
from trainwright.schedule.actions import (
    build_schedule,
    max_in_flight,
    max_waiting_w,
    stage_ranks,
)
from trainwright.schedule.carry import simulated_lists
from trainwright.schedule.occupancy import chunk_states
from trainwright.schedule.peer import with_peer_swap

__all__ = ["PlanRequest", "PlanResult", "make_plan", "calibrated_costs", "slowdown_of",
           "sharing_of", "simulated"]


@dataclass
class PlanRequest:
    """What to plan."""

    layers: list
    """Per-layer profiles in model order
    (:class:`~trainwright.observe.tensor_profile.LayerTensors`)."""
    schedule: str
    pp: int
    micro_batches: int
    topology: DeviceTopology
    """One node's devices (``topology.node_size``; several nodes via
    :func:`~trainwright.plan.devices.cluster`)."""
    budget: list | int | None = None
    """Activation bytes per stage (one value for all); None: from device memory."""
    state_factor: float = 1.0
    """Device bytes per parameter byte for parameters, gradients and optimizer state."""
    reserve: int = 0
    partition: list | None = None
    """Layers per stage; None: min-max by time."""
    rules: Rules = field(default_factory=Rules)
    peer_swap: bool = True
    """Whether peer swap is allowed (False: host swap and recompute only)."""
    latency_s: float = 0.0
    """Per-message latency of every link."""
    step_s: list | float = 0.0
    """Optimizer step time per stage."""
    sync_s: list | float = 0.0
    """Data-parallel gradient sync time per stage."""
    top_mappings: int = 4
    max_rounds: int = 5
    virtual_stages: int = 1
    """Model chunks per rank (``interleaved-1f1b``: 2 or more; ``zb-v``: 2): the model is
    cut into ``pp * virtual_stages`` stages placed on the ranks by the schedule
    (:func:`~trainwright.schedule.actions.stage_ranks`); planned without peer swap."""
    carry_weight_grads: bool = True
    """``zb-v``: simulate the steady step, each rank's carried weight passes first
    (``train.carry_weight_grads``, ``schedule.carry.steady_state``)."""
    calibration: Calibration | None = None
    """Measured per-action, per-segment, send and receive overheads and shared-core
    slowdown of the host whose cores the plan's devices are
    (:mod:`trainwright.plan.calibration`); None for GPU topologies and analytic costs."""
    replicas: int = 1
    """Data-parallel replicas of this pipeline computing at the same time on the same
    host's cores: the calibrated slowdown counts the computing ranks of all of them
    (ignored without :attr:`calibration`)."""


@dataclass
class PlanResult:
    """A plan and what the simulator predicts for it."""

    partition: list[list[int]]
    mapping: list[int]
    """Global device of each stage (``node * node_size + local``)."""
    budgets: list[int | None]
    placement: Placement
    costs: list[StageCost]
    stage_bandwidth: list[list[float]]
    """Stage x stage bytes/s of the link the runtime would use."""
    peers: dict[int, list[int]]
    sim: SimResult
    keep_sim: SimResult
    rounds: list[dict]
    schedule: str
    micro_batches: int
    virtual_stages: int = 1
    stage_ranks: list[int] = field(default_factory=list)
    """Rank of every model stage (the identity with one stage per rank)."""

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return len(self.mapping)

    def config(self) -> dict:
        """The ``trainwright run`` keys this plan stands for (``--set KEY=VALUE``)."""
        return {"train.schedule": self.schedule, "train.micro_batches": self.micro_batches,
                "parallel.pp": self.pp, "parallel.virtual_stages": self.virtual_stages,
                "parallel.partition": [len(x) for x in self.partition]}

    def to_dict(self) -> dict:
        """JSON: the plan, and everything `trainwright simulate` needs to replay it."""
        return {
            "schedule": self.schedule, "pp": self.pp, "virtual_stages": self.virtual_stages,
            "stage_ranks": self.stage_ranks or list(range(self.pp)), "config": self.config(),
            "micro_batches": self.micro_batches, "partition": self.partition,
            "mapping": self.mapping, "budgets": self.budgets,
            "peers": {str(k): v for k, v in self.peers.items()},
            "predicted": {"step_s": self.sim.step_s, "peak_bytes": self.sim.peak_bytes,
                          "activation_peak_bytes": self.sim.own_peak_bytes,
                          "bubble": self.sim.bubble, "slowdown": self.sim.slowdown},
            "all_keep": {"step_s": self.keep_sim.step_s, "peak_bytes": self.keep_sim.peak_bytes},
            "fits": [sp.fits for sp in self.placement.stages],
            "policy_counts": [sp.policy_counts() for sp in self.placement.stages],
            "tensors": [[{"layer": t.layer, "index": t.index, "bytes": t.nbytes,
                          "policy": t.policy,
                          "chunks": [[c.target, c.nbytes] for c in t.chunks]}
                         for t in sp.tensors] for sp in self.placement.stages],
            "rounds": self.rounds,
            "stage_costs": [asdict(c) for c in self.costs],
            "stage_bandwidth": self.stage_bandwidth,
        }


def _per_stage(x, n: int) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x] * n


def calibrated_costs(req: PlanRequest, costs: list[StageCost], parts: list[list[int]],
                     placement: Placement | None) -> list[StageCost]:
    """``costs`` with the request's calibrated overheads (unchanged without one): every
    model stage's compute actions launch :func:`~trainwright.plan.calibration.count_segments`
    segments under the placement's policies."""
    if req.calibration is None:
        return costs
    pols = placement_policies(placement)
    return with_overheads(costs, [count_segments(idx, pols) for idx in parts], req.calibration)


def slowdown_of(req: PlanRequest) -> Callable[[float], float] | None:
    """The simulator's ``slowdown`` for a request: the calibrated factor of ``c`` computing
    ranks of the pipeline times its ``replicas`` (None without a calibration)."""
    cal, dp = req.calibration, max(req.replicas, 1)
    if cal is None:
        return None
    return lambda c: cal.factor(c * dp)


def sharing_of(req: PlanRequest) -> Sharing | None:
    """The processor-sharing replay's terms for a request (None without a calibration that
    measured them): the host's cores shared by the pipeline's ``replicas``, compute at its
    profiled speed (no model's inflation is known here)."""
    cal = req.calibration
    sharing = cal.sharing() if cal is not None else None
    if sharing is None:
        return None
    return dataclasses.replace(sharing, cores=sharing.cores / max(req.replicas, 1))


def simulated(req: PlanRequest, schedule: list[list], costs: list[StageCost],
              links: Links) -> SimResult:
    """:func:`~trainwright.plan.simulate.simulate` under the request's shared-core terms
    (:func:`sharing_of`, else :func:`slowdown_of`)."""
    return simulate(schedule, costs, links, slowdown=slowdown_of(req), sharing=sharing_of(req))


def calibrated_links(req: PlanRequest, links: Links) -> Links:
    """``links`` with the request's calibrated delivery of a message among the job's
    ``pp * replicas`` ranks sharing the host (unchanged without a calibration)."""
    return with_delivery(links, req.calibration, req.pp * max(req.replicas, 1))


def _partition(req: PlanRequest) -> list[list[int]]:
    """Layers of every model stage (``pp * virtual_stages`` of them)."""
    n, n_st = len(req.layers), req.pp * req.virtual_stages
    if req.partition:
        if sum(req.partition) != n or len(req.partition) != n_st or min(req.partition) < 1:
            raise PlanError(f"partition {req.partition} must give each of the {n_st} stages "
                            f"at least one of the {n} layers")
        starts = [sum(req.partition[:s]) for s in range(n_st)]
        return [list(range(a, a + k)) for a, k in zip(starts, req.partition, strict=True)]
    if n_st > n:
        raise PlanError(f"{n_st} stages need at least {n_st} layers; the model has {n}")
    clusters = [ClusterCost((i,), x.forward_s + x.backward_s, x.output_bytes)
                for i, x in enumerate(req.layers)]
    return minmax_partition(clusters, n_st, link_bandwidth=1e9).stages


def _budgets(req: PlanRequest, parts: list[list[int]], ranks: list[int]) -> list:
    """Activation bytes per rank: given, or its device's memory minus its chunks' state."""
    if req.budget is not None:
        return _per_stage(req.budget, req.pp)
    mem = req.topology.memory
    out = []
    for r in range(req.pp):
        mine = [i for k, idx in enumerate(parts) if ranks[k] == r for i in idx]
        state = req.state_factor * sum(req.layers[i].param_bytes for i in mine)
        out.append(int(mem[r % len(mem)] - state - req.reserve))
    return out


def _layout(req: PlanRequest) -> tuple[list[int], list[list], list[int]]:
    """``(rank of every model stage, each rank's action list, each rank's in-flight
    count)``; with several chunks per rank the counts are per chunk
    (:class:`~trainwright.plan.memory.ChunkInFlight`)."""
    v = req.virtual_stages
    sched = build_schedule(req.schedule, req.pp, req.micro_batches, v)
    if v == 1:
        return list(range(req.pp)), sched, [InFlight(max_in_flight(a), max_waiting_w(a))
                                            for a in sched]
    return (stage_ranks(req.schedule, req.pp, v), sched,
            [ChunkInFlight(chunk_states(a)) for a in sched])


def _links(req: PlanRequest, mapping: list[int]) -> tuple[list[list[float]], list[list[float]]]:
    """(stage x stage bandwidth for transfers, stage x stage direct links for peer swap)."""
    topo, ns = req.topology, req.topology.node_size
    pcie = min(topo.host_bandwidth) / 2
    n = len(mapping)
    xfer = [[0.0] * n for _ in range(n)]
    direct = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            da, db = mapping[a], mapping[b]
            if da // ns != db // ns:
                xfer[a][b] = topo.inter_node_bandwidth or pcie
                continue
            bw = topo.bandwidth[da % ns][db % ns]
            direct[a][b] = bw
            xfer[a][b] = bw or pcie
    return xfer, direct


def _candidates(req: PlanRequest, mems: list[StageMem]) -> list[list[int]]:
    """Global mappings, best first: per node the ranked local mappings, combined rank-wise."""
    topo, ns = req.topology, req.topology.node_size
    group = topo.automorphisms()
    per_node = []
    for j in range(0, req.pp, ns):
        local = mems[j : j + ns]
        ranked = search_mappings(local, topo.bandwidth, group, top=req.top_mappings)
        per_node.append([[j // ns * ns + d for d in m] for _, m in ranked])
    depth = max(len(r) for r in per_node)
    return [[d for r in per_node for d in r[min(i, len(r) - 1)]] for i in range(depth)]


def _evaluate(req, parts, mems, mapping, steps, syncs, sched, scale: float = 1.0,
              ranks: list[int] | None = None) -> tuple:
    xfer, direct = _links(req, mapping)
    peer_ok = req.peer_swap and req.virtual_stages == 1
    families = tuple(f for f in req.rules.families if peer_ok or f != "peer")
    rules = Rules(req.rules.short_s, req.rules.long_s, families, req.rules.scale * scale)
    local = list(range(req.pp))  # placement over stage indices, links as stage x stage
    placement = place(mems, local, direct, min(req.topology.host_bandwidth), rules)
    placement.mapping = list(mapping)
    costs = stage_costs(req.layers, parts, placement, local, steps, syncs, ranks)
    costs = calibrated_costs(req, costs, parts, placement)
    peers = {s: sorted(c.peer_bytes) for s, c in enumerate(costs) if c.peer_bytes}
    links = calibrated_links(req, Links(local, xfer, min(req.topology.host_bandwidth),
                                        req.latency_s))
    sched = simulated_lists(req.schedule, sched, req.carry_weight_grads)
    sim = simulated(req, with_peer_swap(sched, peers), costs, links)
    return placement, costs, peers, sim, xfer


def make_plan(req: PlanRequest) -> PlanResult:
    """Plan partition, mapping and per-tensor policies; see the module for the steps.

    Raises:
        PlanError: impossible partition, more stages per node than devices, a deadlock.
    """
    if req.pp < 1 or req.micro_batches < 1:
        raise PlanError(f"need pp >= 1 and micro_batches >= 1, got {req.pp}, "
                        f"{req.micro_batches}")
    bad = [f for f in req.rules.families if f not in FAMILIES]
    if bad:
        raise PlanError(f"unknown policy families {bad}; choose from {FAMILIES}")
    parts = _partition(req)
    ranks, sched, in_flight = _layout(req)
    budgets = _budgets(req, parts, ranks)
    v = req.virtual_stages  # a rank's optimizer step and sync: split evenly over its chunks
    steps = [_per_stage(req.step_s, req.pp)[r] / v for r in ranks]
    syncs = [_per_stage(req.sync_s, req.pp)[r] / v for r in ranks]
    ns = req.topology.node_size
    if req.pp > ns and req.pp % ns:
        raise PlanError(f"{req.pp} stages do not fill whole nodes of {ns} devices; use a "
                        f"multiple of {ns} or at most {ns} stages")
    ident = list(range(req.pp))
    keep_costs = calibrated_costs(req, stage_costs(req.layers, parts, None, ident, steps, syncs,
                                                   ranks), parts, None)
    xfer0, _ = _links(req, ident)
    keep_links = calibrated_links(req, Links(ident, xfer0, min(req.topology.host_bandwidth),
                                             req.latency_s))
    keep_sim = simulated(req, sched, keep_costs, keep_links)
    intervals = liveness(keep_sim, keep_costs, parts)
    mems = stage_mems(req.layers, parts, in_flight, req.micro_batches, budgets, intervals, ranks)
    rounds: list[dict] = []

    def rank(r):
        placement, _, _, sim, _ = r
        return (-sum(sp.fits for sp in placement.stages), sim.step_s)

    best, best_map = None, None
    for mapping in _candidates(req, mems):
        r = _evaluate(req, parts, mems, mapping, steps, syncs, sched, ranks=ranks)
        rounds.append({"round": "mapping", "mapping": mapping, "step_s": r[3].step_s,
                       "fits": sum(sp.fits for sp in r[0].stages),
                       "score": None})
        if best is None or rank(r) < rank(best):
            best, best_map = r, mapping
    best_scale = 1.0
    if req.peer_swap and v == 1 and req.rules.short_s is None:  # a busy host link: prefer the peers
        for scale in (4.0, 16.0, math.inf):
            r = _evaluate(req, parts, mems, best_map, steps, syncs, sched, scale, ranks)
            rounds.append({"round": "thresholds", "scale": str(scale), "step_s": r[3].step_s,
                           "fits": sum(sp.fits for sp in r[0].stages)})
            if rank(r) < rank(best):
                best, best_scale = r, scale
    for _ in range(req.max_rounds):  # simulate, refine, until no better
        placement, costs, _, sim, _ = best
        intervals = liveness(sim, costs, parts)
        mems = stage_mems(req.layers, parts, in_flight, req.micro_batches, budgets, intervals,
                          ranks)
        r = _evaluate(req, parts, mems, best_map, steps, syncs, sched, best_scale, ranks)
        rounds.append({"round": "refine", "mapping": best_map, "step_s": r[3].step_s,
                       "fits": sum(sp.fits for sp in r[0].stages)})
        if rank(r) < rank(best):
            best = r
        else:
            break
    placement, costs, peers, sim, xfer = best
    return PlanResult(parts, list(best_map), budgets, placement, costs, xfer, peers, sim,
                      keep_sim, rounds, req.schedule, req.micro_batches, v, ranks)
