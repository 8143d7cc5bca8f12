"""Rank every way to run a model on given devices: pp x dp, schedule, micro-batches, policies.

``trainwright plan --model SPEC`` asks this module for a ranked answer. A
:class:`Candidate` is one pipeline depth ``pp`` (``dp = devices / pp``), schedule (all
six; interleaved 1F1B with 2-4 chunks per rank, ZB-V with 2), micro-batch size (so a
micro-batch count ``global_batch / dp / size``) and whether peer swap is allowed; the
per-tensor memory policies (keep, peer swap, host swap, recompute) and the stage-to-device
mapping are the planner's choice inside a candidate (:func:`~trainwright.plan.planner.make_plan`).

Two passes keep a 16-device, 256-sequence search within seconds:

1. **screen** every candidate with a cheap plan (one mapping, no refinement) over
   ``max(screen_micro, pp)`` micro-batches, extrapolating the step to the real count with
   the steady-state period (the same placement simulated at ``pp`` more micro-batches gives
   the slope, host and peer links included). With 1F1B-like schedules a rank holds at most
   ``pp`` micro-batches, so the screen's memory is the real one; GPipe holds every
   micro-batch, so it is screened at its real count, and left out (with that reason) past
   :data:`GPIPE_SCREEN_ACTIONS`;
2. **plan** in full (four mappings, threshold scales, refinement rounds, real micro-batch
   count) the best, then again the best, until the best ``full`` are all full plans.

A candidate is rejected with a reason (:attr:`Outcome.reason`): the stage whose
weights, gradients and optimizer state alone exceed the device, or the stage whose
activations exceed what is left, and by how much.

**State bytes** (:func:`bytes_per_param`): weights and gradients in the parameter dtype;
Adam / AdamW keep two moments in fp32, SGD with momentum one; a 16-bit parameter dtype adds
an fp32 master copy (mixed precision). Pure: no torch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from trainwright.plan.choose import PEER_SWAP_SCHEDULES, schedule_candidates
from trainwright.plan.planner import (
    PlanRequest,
    PlanResult,
    calibrated_links,
    make_plan,
    simulated,
)
from trainwright.plan.simulate import Links
from trainwright.plan.stage_inputs import placement_policies
from trainwright.schedule.actions import build_schedule
from trainwright.schedule.carry import simulated_lists
from trainwright.schedule.peer import with_peer_swap

__all__ = ["Candidate", "Outcome", "BytesPerParam", "bytes_per_param", "enumerate_candidates",
           "scaled_layers", "sync_time", "screen", "rank_candidates", "stage_state_bytes",
           "layer_policies", "peer_swapped"]


@dataclass(frozen=True)
class BytesPerParam:
    """Device bytes per parameter for weights, gradients and optimizer state."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """All three."""
        return self.weights + self.grads + self.optimizer


def bytes_per_param(dtype_bytes: int, optimizer: str, momentum: bool = False) -> BytesPerParam:
    """What a parameter of ``dtype_bytes`` costs under ``optimizer`` (``adam``, ``adamw``,
    ``sgd``; ``momentum`` for SGD with momentum), see the module."""
    moments = {"adam": 2, "adamw": 2, "sgd": 1 if momentum else 0}[optimizer]
    master = 4 if dtype_bytes < 4 else 0
    return BytesPerParam(dtype_bytes, dtype_bytes, 4 * moments + master)


def stage_state_bytes(plan: PlanResult, layers: list, per: BytesPerParam,
                      dtype_bytes: int) -> list[dict]:
    """Per rank: ``weights``, ``grads``, ``optimizer`` bytes of the layers it holds."""
    ranks = plan.stage_ranks or list(range(plan.pp))
    out = []
    for r in range(plan.pp):
        params = sum(layers[i].param_bytes for k, idx in enumerate(plan.partition)
                     if ranks[k] == r for i in idx) // dtype_bytes
        out.append({"weights": params * per.weights, "grads": params * per.grads,
                    "optimizer": params * per.optimizer})
    return out


@dataclass(frozen=True)
class Candidate:
    """One way to run the model (the planner chooses policies and mapping inside it)."""

    pp: int
    dp: int
    schedule: str
    virtual_stages: int
    micro_batch_size: int
    micro_batches: int
    peer_swap: bool

    def label(self) -> str:
        """``"pp4 x dp4 1f1b m=16 (mbs 4)"``."""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"pp{self.pp} x dp{self.dp} {self.schedule}{v} m={self.micro_batches} "
                f"(mbs {self.micro_batch_size}){'' if self.peer_swap else ' no-peer'}")


@dataclass
class Outcome:
    """A candidate's prediction, or why it was rejected."""

    candidate: Candidate
    plan: PlanResult | None = None
    step_s: float = math.inf
    fits: bool = False
    reason: str = ""
    """Why it was rejected (empty when it fits)."""
    planned: str = "screen"
    """``"screen"`` (cheap pass, step extrapolated) or ``"full"``."""
    state: list[dict] = field(default_factory=list)
    """Per rank: weights / grads / optimizer bytes."""
    peak_bytes: list[int] = field(default_factory=list)
    """Per rank: state + predicted activation peak (+ chunks held for peers)."""

    def key(self) -> tuple:
        """Best first: fits, then least predicted step time."""
        return (not self.fits, self.step_s, self.candidate.label())


GPIPE_SCREEN_ACTIONS = 128
"""GPipe is screened at its real micro-batch count only up to ``pp * m`` of this; past it
1F1B at the same depth dominates it (same bubble, less memory) and it is left out."""


def sync_time(grad_bytes: float, pp: int, dp: int, topo) -> float:
    """A ring all-reduce of one stage's gradients over its ``dp`` replicas: ``2 (dp - 1) / dp
    * bytes / bandwidth``, over the network when the replicas (``pp`` ranks apart) span
    nodes, else over the node's slowest device link."""
    if dp <= 1:
        return 0.0
    ns = topo.node_size
    links = [b for i, r in enumerate(topo.bandwidth) for j, b in enumerate(r) if i != j and b]
    local = min(links) if links else min(topo.host_bandwidth) / 2
    bw = (topo.inter_node_bandwidth or local) if pp * dp > ns else local
    return 2 * (dp - 1) / dp * grad_bytes / bw


def scaled_layers(layers: list, k: int) -> list:
    """Per-layer rows of a ``k``-sample micro-batch from those of one sample: bytes and
    times times ``k`` (parameters unchanged). Activations are linear in the batch; times
    are at least (a device runs a larger batch no slower per sample)."""
    if k == 1:
        return layers
    out = []
    for row in layers:
        r = copy.copy(row)
        r.forward_s, r.backward_s = row.forward_s * k, row.backward_s * k
        r.input_bytes, r.output_bytes = row.input_bytes * k, row.output_bytes * k
        r.tensors = [replace(t, nbytes=t.nbytes * k) for t in row.tensors]
        out.append(r)
    return out


def enumerate_candidates(n_devices: int, node_size: int, n_layers: int, global_batch: int,
                         micro_batch_sizes: list[int], pp_options: list[int] | None = None,
                         peer_swap: bool = True) -> tuple[list[Candidate], list[dict]]:
    """Every candidate, and the combinations left out with why.

    ``pp`` runs over the divisors of ``n_devices`` that fill whole nodes (or fit in one)
    and leave every stage a layer, unless ``pp_options`` names them.
    """
    pps = pp_options or [p for p in range(1, min(n_devices, n_layers) + 1)
                         if n_devices % p == 0 and (p <= node_size or p % node_size == 0)]
    out, skipped = [], []
    for pp in pps:
        dp = n_devices // pp
        for mbs in micro_batch_sizes:
            if global_batch % (dp * mbs):
                skipped.append({"pp": pp, "dp": dp, "micro_batch_size": mbs,
                                "skipped": f"global batch {global_batch} does not split into "
                                           f"{dp} replicas x micro-batches of {mbs}"})
                continue
            m = global_batch // (dp * mbs)
            if pp == 1:
                pairs, why = [("1f1b", 1)], []
            else:
                pairs, why = schedule_candidates(pp, m, n_layers)
            skipped += [{**w, "dp": dp, "micro_batch_size": mbs} for w in why]
            for schedule, v in pairs:
                out.append(Candidate(pp, dp, schedule, v, mbs, m,
                                     peer_swap and schedule in PEER_SWAP_SCHEDULES))
    return out, skipped


def _step_at(plan: PlanResult, req: PlanRequest, m: int) -> float:
    """The plan's step time simulated at ``m`` micro-batches (same placement and costs:
    ``plan.costs`` carry the request's calibrated overheads; its shared-core slowdown,
    every replica counted, is applied again here)."""
    sched = build_schedule(plan.schedule, plan.pp, m, plan.virtual_stages)
    sched = simulated_lists(plan.schedule, sched, req.carry_weight_grads)
    links = calibrated_links(req, Links(list(range(plan.pp)), plan.stage_bandwidth,
                                        min(req.topology.host_bandwidth), req.latency_s))
    return simulated(req, with_peer_swap(sched, plan.peers), plan.costs, links).step_s


def _extrapolated(plan: PlanResult, req: PlanRequest, m: int) -> float:
    """Step time at ``m`` micro-batches from a plan simulated at fewer: the period of the
    steady state (one more simulation at ``pp`` more micro-batches gives the slope, host
    and peer links included), times the micro-batches left."""
    m0 = plan.micro_batches
    if m <= m0:
        return plan.sim.step_s
    m1 = min(m, m0 + plan.pp)
    s1 = _step_at(plan, req, m1)
    return s1 + (m - m1) * (s1 - plan.sim.step_s) / (m1 - m0)


def _judge(out: Outcome, plan: PlanResult, layers: list, per: BytesPerParam,
           dtype_bytes: int, memory: list[int], reserve: int) -> None:
    """Fill ``fits``, ``reason``, ``state`` and ``peak_bytes`` from a plan."""
    out.plan = plan
    out.state = stage_state_bytes(plan, layers, per, dtype_bytes)
    act = plan.sim.peak_bytes
    out.peak_bytes = [sum(s.values()) + (act[r] if r < len(act) else 0)
                      for r, s in enumerate(out.state)]
    worst, over = None, 0
    for r, sp in enumerate(plan.placement.stages):
        mem = memory[plan.mapping[r] % len(memory)]
        state = sum(out.state[r].values())
        if state + reserve > mem:
            if over < state + reserve - mem or worst is None or "activations" in worst:
                worst = (f"does not fit: stage {r}'s weights, gradients and optimizer state "
                         f"({_gib(state)}) exceed the device's {_gib(mem)} less the reserve "
                         f"by {_gib(state + reserve - mem)}")
                over = state + reserve - mem
        elif not sp.fits and plan.budgets[r] is not None:
            extra = sp.required_bytes - plan.budgets[r]
            if worst is None or ("activations" in worst and extra > over):
                worst = (f"does not fit: stage {r}'s activations need {_gib(sp.required_bytes)}"
                         f" with the best policies, {_gib(extra)} more than the "
                         f"{_gib(plan.budgets[r])} its device has left")
                over = extra
    out.fits = worst is None
    out.reason = worst or ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def screen(c: Candidate, layers: list, base: PlanRequest, per: BytesPerParam,
           dtype_bytes: int, screen_micro: int = 0) -> Outcome:
    """Plan one candidate: the cheap screen when ``screen_micro`` > 0, else in full.

    Args:
        c: the candidate.
        layers: per-layer rows of one micro-batch of ``c.micro_batch_size`` samples.
        base: topology, reserve, state factor, latency, calibration (the rest is the
            candidate's; ``replicas`` is its ``dp``).
        per: bytes per parameter; ``dtype_bytes``: of one parameter.
        screen_micro: most micro-batches simulated in the screen (0: plan in full).
    """
    out = Outcome(c)
    m = c.micro_batches
    m_sim = m if not screen_micro else min(m, max(screen_micro, c.pp))
    if c.schedule == "gpipe" and m_sim < m:  # every micro-batch in flight: needs the real m
        if c.pp * m > GPIPE_SCREEN_ACTIONS:
            out.reason = (f"not planned: GPipe holds all {m} micro-batches, 1F1B at the same "
                          f"depth has the same bubble and at most {c.pp} in flight")
            return out
        m_sim = m
    if c.schedule == "interleaved-1f1b" and m_sim % c.pp:
        m_sim = m
    state = sum(x.param_bytes for x in layers) // dtype_bytes * per.total / c.pp
    mem = max(base.topology.memory)
    if state + base.reserve > mem:  # the busiest stage holds at least the average
        out.reason = (f"does not fit: weights, gradients and optimizer state are "
                      f"{_gib(state)} per stage on average over {c.pp} stages, more than "
                      f"the device's {_gib(mem)} less the {_gib(base.reserve)} reserve")
        return out
    grad = sum(x.param_bytes for x in layers) / c.pp  # gradients in the parameter dtype
    cheap = dict(top_mappings=1, max_rounds=0) if screen_micro else {}
    req = replace(base, layers=layers, schedule=c.schedule, pp=c.pp, micro_batches=m_sim,
                  sync_s=sync_time(grad, c.pp, c.dp, base.topology),
                  virtual_stages=c.virtual_stages, peer_swap=c.peer_swap, replicas=c.dp,
                  **cheap)
    try:
        plan = make_plan(req)
    except Exception as exc:  # a combination the planner cannot build is reported, not fatal
        out.reason = f"cannot be planned: {str(exc)[:160]}"
        return out
    _judge(out, plan, layers, per, dtype_bytes, base.topology.memory, base.reserve)
    out.step_s = _extrapolated(plan, req, m)
    out.planned = "screen" if screen_micro else "full"
    return out


def rank_candidates(cands: list[Candidate], rows_for: dict[int, list], base: PlanRequest,
                    per: BytesPerParam, dtype_bytes: int, screen_micro: int = 4,
                    full: int = 3) -> list[Outcome]:
    """Screen every candidate, plan the best ``full`` in full; every outcome, best first.

    Args:
        rows_for: micro-batch size -> per-layer rows (:func:`scaled_layers`).
    """
    outs = [screen(c, rows_for[c.micro_batch_size], base, per, dtype_bytes, screen_micro)
            for c in cands]
    for _ in range(4 * full):  # until the best `full` are all planned in full
        outs.sort(key=Outcome.key)
        todo = [i for i, o in enumerate(outs[:full]) if o.plan is not None and
                o.planned == "screen"]
        if not todo:
            break
        i = todo[0]
        outs[i] = screen(outs[i].candidate, rows_for[outs[i].candidate.micro_batch_size],
                         base, per, dtype_bytes)
    outs.sort(key=Outcome.key)
    return outs


def layer_policies(plan: PlanResult, n_layers: int) -> list[str]:
    """``memory.policies`` of a plan, one per layer: a layer with a recomputed tensor is
    recomputed, one with a host-swapped tensor swapped, the rest kept (peer-swapped tensors
    are the peer-swap runtime's, see :func:`peer_swapped`)."""
    pols = placement_policies(plan.placement)
    return [p if p in ("recompute", "swap") else "keep"
            for p in (pols.get(i, "keep") for i in range(n_layers))]


def peer_swapped(plan: PlanResult) -> bool:
    """Whether any tensor of the plan goes to a peer device."""
    return any(t.policy == "peer" for sp in plan.placement.stages for t in sp.tensors)
