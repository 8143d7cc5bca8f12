"""A stage's activation-memory budget: plan the per-layer policies and re-plan on change.

The planners themselves are pure (:mod:`trainwright.plan.memory`); this module feeds them
the stage's measured cost table, applies the plan to the activation store, and re-plans
when the re-plan trigger fires (over the limit, or under it with a needless recompute) or
when the stage's layers change (:meth:`MemoryBudget.on_layers_changed`, called by
rebalancing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from trainwright.config import Config, parse_bytes
from trainwright.errors import ConfigError, PlanError
from trainwright.observe.layer_profile import LayerCost
from trainwright.pipeline.profile import ProfileTable, profile_model
from trainwright.pipeline.stage import Stage
from trainwright.plan.fit import fit_plan
from trainwright.plan.footprint import (
    Footprint,
    LayerTerms,
    arrivals,
    stage_footprint,
    walk,
)
from trainwright.plan.memory import (
    POLICIES,
    ChunkInFlight,
    InFlight,
    LayerMem,
    MemoryPlan,
    format_bytes,
    plan_stage,
    required_bytes,
)
from trainwright.schedule.actions import build_schedule, max_in_flight, max_waiting_w, stage_ranks
from trainwright.schedule.occupancy import chunk_states

__all__ = ["MemoryBudget", "measure_host_bandwidth",
           "layer_mems", "check_limits", "stage_in_flight", "resolve_limit", "rank_chunks",
           "chunked_layer_mems", "rank_terms", "predicted_footprints"]

log = logging.getLogger(__name__)


def measure_host_bandwidth(device: torch.device, nbytes: int = 32 * 2**20) -> float:
    """Bytes/s of a device-to-host copy (pinned host memory on CUDA), best of 3."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def stage_in_flight(cfg: Config) -> list[int]:
    """Micro-batches each stage holds at most under the configured schedule (zero bubble: up
    to their ``W``, with how many wait between ``B`` and ``W``: :class:`InFlight`); with
    several chunks per rank, each chunk's own counts at every peak (:class:`ChunkInFlight`)."""
    sched = build_schedule(cfg.train.schedule, cfg.parallel.pp, cfg.train.micro_batches,
                           cfg.parallel.virtual_stages)  # interleaved: per rank, all chunks
    if cfg.parallel.virtual_stages > 1:  # the interleaved runtime posts receives ahead
        arrive = [arrivals(actions) for actions in sched]
        return [ChunkInFlight(chunk_states(actions), actions, got)
                for actions, got in zip(sched, arrive, strict=True)]
    return [InFlight(max_in_flight(actions), max_waiting_w(actions), actions, None)
            for actions in sched]


def rank_chunks(cfg: Config, parts: list[int]) -> list[dict[int, list[int]]]:
    """Per pipeline rank: model stage (chunk) -> its layer indices, by the schedule's
    placement (:func:`~trainwright.schedule.actions.stage_ranks`)."""
    ranks = stage_ranks(cfg.train.schedule, cfg.parallel.pp, cfg.parallel.virtual_stages)
    out: list[dict[int, list[int]]] = [{} for _ in range(cfg.parallel.pp)]
    for k, r in enumerate(ranks):
        first = sum(parts[:k])
        out[r][k] = list(range(first, first + parts[k]))
    return out


def chunked_layer_mems(costs: list[LayerCost], chunks: dict[int, list[int]]) -> list[LayerMem]:
    """:func:`layer_mems` of each chunk (its last output held until its backward), every
    row tagged with its chunk, in chunk order."""
    by_layer = {c.layer: c for c in costs}
    return [x for k in sorted(chunks)
            for x in layer_mems([by_layer[i] for i in chunks[k] if i in by_layer], chunk=k)]


def resolve_limit(limit: int | str | None, cfg: Config, device: torch.device) -> int | None:
    """Bytes for a stage limit; ``"auto"`` is the CUDA device's memory minus the reserve."""
    if limit != "auto":
        return limit
    if device.type != "cuda":
        log.warning("memory.limit = \"auto\" needs a CUDA device; running without a limit")
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(total - parse_bytes(cfg.memory.reserve), 1)


def check_limits(cfg: Config, named: list) -> list[LayerCost] | None:
    """Profile once and reject a ``memory.limit`` that no policy can meet.

    Call before launching anything, so a bad limit exits with nothing started or written.

    Returns:
        The whole model's cost table, or None when no stage has a byte limit.

    Raises:
        ConfigError: naming the smallest feasible limit of every stage.
    """
    limits = cfg.stage_limits()
    if not any(isinstance(v, int) for v in limits):
        return None
    costs = profile_model(cfg, named)
    terms = rank_terms(cfg, costs)
    need, short = [], False
    for s, (limit, flight) in enumerate(zip(limits, stage_in_flight(cfg), strict=True)):
        # by the footprint walk: every layer swapped or recomputed, the better of the two
        least = 1 + min(walk(terms[s], {x.layer: p for x in terms[s]}, list(flight.actions),
                             arrive=flight.arrive)[0] for p in ("swap", "recompute"))
        need.append(least)
        short |= isinstance(limit, int) and limit < least
    if short:
        unit = "rank" if cfg.parallel.virtual_stages > 1 else "stage"  # a rank: all its chunks
        per_stage = ", ".join(f"{unit} {s} {format_bytes(n)} ({n} B)" for s, n in enumerate(need))
        raise ConfigError(f"memory.limit = {cfg.memory.limit!r} cannot be met even with every "
                          f"layer recomputed (or swapped; footprint model: working sets and "
                          f"receive buffers included); the smallest feasible limits are: "
                          f"{per_stage}. "
                          f"Raise memory.limit (one value, or one per stage) or use more "
                          f"stages" + (" or train.schedule=\"1f1b\" (fewer micro-batches in "
                                       "flight)" if cfg.train.schedule == "gpipe" else ""))
    return costs


def layer_mems(costs: list[LayerCost], chunk: int = 0) -> list[LayerMem]:
    """Planner input for one stage's (or chunk's) layers (in order).

    The stage's last output is held until its backward (it is sent on, or it is the loss),
    so its bytes are added to the last layer's always-resident input bytes.
    """
    mems = [LayerMem(c.layer, c.saved_bytes, c.input_bytes, c.forward_s, c.backward_s, chunk)
            for c in costs]
    if mems:
        last = mems[-1]
        mems[-1] = LayerMem(last.layer, last.saved_bytes,
                            last.input_bytes + costs[-1].output_bytes, last.forward_s,
                            last.backward_s, chunk)
    return mems


class MemoryBudget:
    """Keeps one stage's activations under its limit by choosing per-layer policies.

    Args:
        stage: the stage whose store gets the policies.
        in_flight: micro-batches the stage holds at most (``p - i`` in 1F1B, ``m`` in GPipe).
        limit: activation bytes allowed, or None.
        planner: ``"greedy"`` or ``"optimal"``.
        host_bandwidth: device-to-host bytes/s.
        fixed: policies forced by the configuration (no planning), or None.
        chunks: with several chunks per rank, chunk -> its layer indices (``in_flight`` is
            then a :class:`~trainwright.plan.memory.ChunkInFlight`); None: one stage.
    """

    def __init__(self, stage: Stage, in_flight: int, limit: int | None, planner: str,
                 host_bandwidth: float, fixed: dict[int, str] | None = None,
                 chunks: dict[int, list[int]] | None = None):
        self.stage, self.in_flight, self.limit = stage, in_flight, limit
        self.planner, self.host_bandwidth = planner, host_bandwidth
        self.fixed, self.chunks = fixed, chunks
        self.plan: MemoryPlan | None = None
        self.allocator_excess = 0
        """Bytes the CUDA allocator measured beyond the plan's prediction, at most (learned
        by :meth:`check_allocator`): plans are made against ``limit`` less this."""
        self.terms: dict[int, LayerTerms] = {}
        """Footprint terms per layer, from the first :class:`ProfileTable` given to
        :meth:`replan` (measured once); with them plans are held to the footprint walk."""
        if fixed is not None:
            stage.store.set_policies({s.index: fixed[s.index] for s in stage.slots})

    def replan(self, costs: list[LayerCost] | None = None, why: str = "",
               only_if_over: bool = False) -> MemoryPlan | None:
        """Plan again if the re-plan trigger fires; apply and return a changed plan, else None.

        Args:
            costs: the stage's per-layer costs (default: the profiler's current table).
            why: context for the log line (e.g. "before step 1").
            only_if_over: re-plan only when the measured costs exceed the limit. Periodic
                checks use this: the other trigger (a recompute while under the
                limit) is meant for a changed partition, and would otherwise re-make a plan
                that recomputes on purpose at every check.
        """
        if self.fixed is not None or self.limit is None:
            return None  # policies are fixed, or there is nothing to fit under
        if isinstance(costs, ProfileTable):
            self.terms = {**self.terms, **costs.terms}
        mems = self._mems(costs or self.stage.profiler.table())
        current = {s.index: self.stage.store.policy(s.index) for s in self.stage.slots}
        terms = [self.terms.get(x.layer) for x in mems]
        walked = (isinstance(self.in_flight, (InFlight, ChunkInFlight))
                  and bool(self.in_flight.actions) and all(t is not None for t in terms))
        if walked:  # tagged with the model stage each runs as (the actions' ``stage``)
            own = self.in_flight.actions[0].stage
            terms = [replace(t, chunk=x.chunk if self.chunks is not None else own)
                     for t, x in zip(terms, mems, strict=True)]
        target = self.limit - self.allocator_excess
        if only_if_over and required_bytes(mems, current, self.in_flight) < target:
            return None
        if walked:
            plan = fit_plan(mems, terms, self.in_flight, target, self.host_bandwidth,
                            planner=self.planner, current=current,
                            copy_back=self.stage.store.swap.cuda)
        else:
            plan = plan_stage(mems, self.in_flight, target, self.host_bandwidth,
                              planner=self.planner, current=current)
        if plan is None or (self.plan is not None and plan.policies == current):
            return None
        self.stage.store.set_policies(plan.policies)
        self.plan = plan
        counts = {p: sum(v == p for v in plan.policies.values())
                  for p in POLICIES}
        log.info("memory plan %s (%s, %s): keep %d, swap %d, recompute %d; needs %s of %s; "
                 "adds %.1f ms per micro-batch", why, plan.planner, plan.reason,
                 counts["keep"], counts["swap"], counts["recompute"],
                 format_bytes(plan.required_bytes),
                 format_bytes(target) if self.limit else "no limit",
                 1e3 * plan.added_time_s)
        return plan

    def check_allocator(self, peak_bytes: int, step: int) -> MemoryPlan | None:
        """Hold the plan to the CUDA allocator: re-plan when a step's activation peak by the
        allocator (:attr:`~trainwright.pipeline.runtime.StepStats.cuda_activation_peak_bytes`)
        exceeded the limit.

        The footprint model sees the storages tensors own; the allocator also holds what
        kernels allocate inside an op (workspaces, rounding, backward intermediates). What
        it measured beyond the plan's prediction is remembered (:attr:`allocator_excess`,
        the most seen) and the stage is planned again against the limit less that.

        Returns:
            The new plan, or None (within the limit, nothing planned, or no plan fits the
            lowered bound: then a warning names the shortfall).
        """
        if self.fixed is not None or self.limit is None or self.plan is None \
                or peak_bytes <= self.limit:
            return None
        excess = peak_bytes - self.plan.required_bytes
        if excess <= self.allocator_excess:
            return None  # not from this plan (made before the last correction)
        self.allocator_excess = excess
        why = (f"after step {step}: the CUDA allocator measured {format_bytes(peak_bytes)} "
               f"over the {format_bytes(self.limit)} limit, {format_bytes(excess)} more than "
               f"the plan predicted")
        try:
            return self.replan(why=why)
        except PlanError as exc:
            log.warning("memory plan %s, and no plan fits the limit less that: %s. Raise "
                        "memory.limit or use more stages", why, exc)
            return None

    def _mems(self, costs: list[LayerCost]) -> list[LayerMem]:
        """Planner rows of this stage's layers (per chunk with several chunks per rank)."""
        if self.chunks is not None:
            return chunked_layer_mems(costs, self.chunks)
        mine = {s.index for s in self.stage.slots}
        return layer_mems([c for c in costs if c.layer in mine])

    def on_layers_changed(self) -> MemoryPlan | None:
        """Re-planning hook: the stage gained or lost layers (rebalancing)."""
        return self.replan(why="after a change of layers")

    def record(self) -> dict:
        """The current plan as the metrics row's ``memory_plan`` (call with a plan)."""
        plan = self.plan
        return {"planner": plan.planner, "reason": plan.reason,
                "required_bytes": plan.required_bytes, "limit_bytes": plan.limit_bytes,
                "added_time_s": plan.added_time_s, "host_bandwidth": self.host_bandwidth,
                "allocator_excess_bytes": self.allocator_excess, "layers": self.rows()}

    def rows(self) -> list[dict]:
        """The current plan per layer, for the metrics and the report."""
        if self.plan is None:
            return []
        return self.plan.to_rows(self._mems(self.stage.profiler.table()), self.host_bandwidth)


def rank_terms(cfg: Config, table: ProfileTable) -> list[list[LayerTerms]]:
    """Per pipeline rank, the footprint terms of its layers, each tagged with its chunk."""
    chunks = rank_chunks(cfg, cfg.partition(len(table)))
    return [[replace(table.terms[i], chunk=k) for k in sorted(ch) for i in ch[k]]
            for ch in chunks]


def predicted_footprints(cfg: Config, table: ProfileTable,
                         policies: list[dict[int, str]] | None = None,
                         host_bandwidth: float | None = None) -> list[Footprint]:
    """The footprint model's prediction for every pipeline rank of ``cfg``.

    This is what the planner and the benchmarks compare with the meter: ``activations``
    (device-resident, the live meter's device bytes) and ``host`` (swap copies, the meter's
    host bytes) per rank, plus the static terms.

    Args:
        cfg: the configuration (schedule, partition, optimizer, ``memory.*``).
        table: :func:`profile_model`'s table for ``cfg``'s model (measured once).
        policies: per rank, layer -> policy; None: what the run would use, i.e.
            ``memory.policies`` when fixed, else the plan :class:`MemoryBudget` makes under
            ``memory.limit`` (no limit: all kept).
        host_bandwidth: bytes/s for the policy planners (``memory.host_bandwidth`` when
            set, else 1e9; it changes only swap-versus-recompute choices).

    Returns:
        One :class:`~trainwright.plan.footprint.Footprint` per rank.

    Raises:
        PlanError: a limit no plan fits (as the run would).
    """
    terms = rank_terms(cfg, table)
    flights = stage_in_flight(cfg)
    chunks = rank_chunks(cfg, cfg.partition(len(table)))
    fixed = cfg.layer_policies(len(table))
    limits = cfg.stage_limits()
    bandwidth = host_bandwidth or cfg.memory.host_bandwidth or 1e9
    out = []
    for r, (rows, flight) in enumerate(zip(terms, flights, strict=True)):
        if policies is not None:
            pol = policies[r]
        elif fixed is not None:
            pol = {x.layer: fixed[x.layer] for x in rows}
        elif isinstance(limits[r], int):
            mems = chunked_layer_mems(list(table), chunks[r])
            plan = fit_plan(mems, rows, flight, limits[r], bandwidth, cfg.memory.planner)
            pol = plan.policies if plan is not None else {}
        else:
            pol = {}
        out.append(stage_footprint(rows, pol, list(flight.actions), cfg.train.optimizer,
                                   cfg.train.momentum, arrive=flight.arrive))
    return out
