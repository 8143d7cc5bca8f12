"""``memory.peer_swap = true``: plan peer swap for this job at start, then wire it in.

Rank 0 profiles every saved tensor of one micro-batch (:func:`~trainwright.observe.tensor_profile.
profile_tensors`, on copies of the layers so training is untouched), and the tensor-level
planner (:func:`~trainwright.plan.planner.make_plan`, the engine of ``trainwright plan``)
places them under each stage's ``memory.limit``: peer swap to the spare memory of other
stages first, then recompute or host swap. Every rank receives the plan; each stage gets
the plan's per-layer runtime policies (a layer with a recomputed tensor is recomputed, one
with a host tensor is swapped), the peer-swap actions in its schedule, and a
:class:`~trainwright.pipeline.peerswap.PeerSwap` on its activation store.
"""

from __future__ import annotations

import copy
import logging
import os

import torch

from trainwright.dist import collective as coll
from trainwright.errors import ConfigError
from trainwright.pipeline.peerswap import PeerSwap, metadata_table

__all__ = ["runtime_policies", "peer_plan_json", "plan_job", "agree_plan", "attach"]

log = logging.getLogger(__name__)


def runtime_policies(plan: dict) -> dict[int, str]:
    """Per-layer runtime policies of a plan in JSON form (``plan["tensors"]``): a layer
    with a recomputed tensor is recomputed, one with a host-swapped tensor is swapped."""
    out: dict[int, str] = {}
    for stage in plan["tensors"]:
        for t in stage:
            if t["policy"] == "recompute":
                out[t["layer"]] = "recompute"
            elif t["policy"] == "host" and out.get(t["layer"]) != "recompute":
                out[t["layer"]] = "swap"
    return out


def peer_plan_json(plan: dict) -> dict:
    """What :class:`~trainwright.pipeline.peerswap.PeerSwap` needs from a plan."""
    return {"tensors": plan["tensors"], "peers": plan["peers"]}


def _free_bytes(device: torch.device, local_ranks: int) -> int:
    """Memory a stage without a limit could lend to peers."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(local_ranks, 1)


def stage_free_bytes(topo, free: int) -> list[int]:
    """Every stage's own free memory, in stage order (collective over this rank's
    pipeline): ``free`` is this rank's (``_free_bytes`` of its own device), so a GPU with
    less free memory is planned as such rather than as rank 0's."""
    rows = coll.all_gather_objects((topo.stage, int(free)), topo.pp, group=topo.pp_group)
    by_stage = dict(rows)
    return [by_stage[s] for s in range(topo.pp)]


def plan_job(cfg, named: list, parts: list[int], limits: list[int | None], topology,
             sample: tuple[torch.Tensor, torch.Tensor],
             device: torch.device | None = None) -> dict:
    """The plan (``trainwright plan`` JSON form) for this job's model and limits.

    Args:
        named: ``(name, module)`` of every layer (profiled on copies).
        parts: layers per stage.
        limits: activation bytes per stage (None: what the device has free).
        topology: a :class:`~trainwright.plan.devices.DeviceTopology` with one device per stage.
        sample: one micro-batch ``(inputs, targets)``.
        device: where the layers are profiled (copies, default CPU; on a GPU timed with CUDA events:
            :func:`~trainwright.observe.timing.device_timer`).

    Raises:
        ConfigError: a stage that cannot fit its limit even with peer swap, recompute and
            host swap.
    """
    from trainwright.model.build import loss_fn
    from trainwright.observe.tensor_profile import profile_tensors
    from trainwright.plan.planner import PlanRequest, make_plan

    device = device or torch.device("cpu")
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # profiling must not move training's RNG
        rows = profile_tensors([(n, copy.deepcopy(m).to(device)) for n, m in named],
                               sample[0].to(device), sample[1].to(device), loss_fn(cfg))
    budgets = [lim if lim is not None else topology.memory[s] for s, lim in enumerate(limits)]
    req = PlanRequest(rows, cfg.train.schedule, cfg.parallel.pp, cfg.train.micro_batches,
                      topology, budget=budgets, partition=list(parts))
    plan = make_plan(req)
    out = plan.to_dict()
    bad = [s for s, fits in enumerate(out["fits"]) if not fits]
    if bad:
        s = bad[0]
        raise ConfigError(
            f"memory.limit: stage {s} cannot keep its activations under {budgets[s]} bytes "
            f"even with peer swap, recompute and host swap (the plan still needs "
            f"{out['predicted']['activation_peak_bytes'][s]} bytes there); raise its limit, "
            f"lower train.micro_batches, or use more stages (parallel.pp)")
    return out


def agree_plan(cfg, named: list, parts: list[int], limits: list[int | None], topo,
               device: torch.device, sample) -> dict:
    """Rank 0 plans, every rank gets the same plan (collective over the default group).

    Link bandwidths come from ``memory.peer_bandwidth`` or a send/recv ping between the
    stages of each replica (:func:`~trainwright.plan.devices.measure_p2p`).
    """
    from trainwright.dist.probe import measure_p2p
    from trainwright.pipeline.budget import measure_host_bandwidth
    from trainwright.plan.devices import DeviceTopology

    pp, bw = cfg.parallel.pp, cfg.memory.peer_bandwidth
    if bw:
        matrix = [[0.0 if i == j else bw for j in range(pp)] for i in range(pp)]
    else:
        matrix = measure_p2p(group=topo.pp_group).bandwidth  # collective on every replica
    box: list = [None]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
    free = stage_free_bytes(topo, _free_bytes(device, local))  # each stage's own device
    if topo.rank == 0:
        host = cfg.memory.host_bandwidth or measure_host_bandwidth(device)
        try:
            box[0] = plan_job(cfg, named, parts, limits,
                              DeviceTopology("measured", free, matrix, [host] * pp), sample,
                              device)
        except ConfigError as exc:
            box[0] = exc
    coll.broadcast_object_list(box, src=0)
    if isinstance(box[0], ConfigError):
        raise box[0]
    plan = box[0]
    if topo.rank == 0:
        log.info("peer swap plan: policy counts per stage %s, predicted step %.3f s, peaks %s",
                 plan["policy_counts"], plan["predicted"]["step_s"],
                 plan["predicted"]["peak_bytes"])
    return plan


def attach(plan: dict, rank: int, stage: int, stage_rank: dict[int, int], store,
           schedules: list, timeout_s: float, group=None) -> tuple[list, PeerSwap]:
    """Wire ``plan`` into this rank (stage ``stage``; ``stage_rank``: stage -> rank of this
    pipeline): returns its action list (with the peer-swap actions) and the
    :class:`PeerSwap` that runs them (its :meth:`PeerSwap.extensions` and
    :meth:`PeerSwap.after` go to the runtime); the store gets it too. ``group`` is the
    transfer group; None creates one (collective: every rank calls)."""
    from trainwright.schedule.peer import with_peer_swap

    peers = {int(k): v for k, v in plan["peers"].items()}
    tables = {r: metadata_table(plan["tensors"][k], stage_rank) for k, r in stage_rank.items()}
    group = group if group is not None else PeerSwap.new_group()
    peer = PeerSwap(rank, tables[rank], tables, store, group, stage_rank, timeout_s)
    store.peer = peer
    return with_peer_swap(schedules, peers)[stage], peer
