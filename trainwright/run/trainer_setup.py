"""The set-up half of :class:`~trainwright.run.trainer.Trainer`: its named set-up steps.

:class:`TrainerSetup` builds one rank's share of a job from the config, in the order
``Trainer.__init__`` calls them: the layers (resumed partition included), the stage and
its activation store, the schedule (and a peer-swap plan), the gradient exchange, the
runtime, the rebalancer, the memory budget, the telemetry, and the resumed state. The
step loop that uses what they build is in :mod:`trainwright.run.trainer`.
"""

from __future__ import annotations

import json
import logging

import torch

from trainwright.dist.comm import P2P
from trainwright.dist.mailbox import Mailbox
from trainwright.errors import PeerLost
from trainwright.model.build import build_optimizer, loss_fn, split_microbatches
from trainwright.model.clusters import model_clusters
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.observe.telemetry import RunRecorder, atomic_write_text
from trainwright.pipeline.budget import (
    MemoryBudget,
    measure_host_bandwidth,
    profile_model,
    resolve_limit,
    stage_in_flight,
)
from trainwright.pipeline.edit import load_edit_hook
from trainwright.pipeline.interleaved import InterleavedRuntime, chunk_stages
from trainwright.pipeline.peer_setup import agree_plan, runtime_policies
from trainwright.pipeline.peer_setup import attach as attach_peer_swap
from trainwright.pipeline.rebalance import LayerCatalog
from trainwright.pipeline.repartition import Rebalancer
from trainwright.pipeline.runtime import PipelineRuntime, kill_self_at
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import ActivationStore
from trainwright.pipeline.tied import duplicate_copies, owned_parameters, prepare_ties, wrap_tied
from trainwright.run import checkpoint
from trainwright.run.precision import autocast_factory
from trainwright.run.update import UpdateStep, make_update_step
from trainwright.schedule.actions import build_schedule, stage_ranks
from trainwright.sync import GradSync, make_grad_sync

__all__ = ["NamedLayers", "TrainerSetup"]

log = logging.getLogger(__name__)

NamedLayers = list[tuple[str, torch.nn.Module]]


class TrainerSetup:
    """The set-up steps of a :class:`~trainwright.run.trainer.Trainer` (see its arguments);
    not used on its own."""

    def _setup_layers(self, resume: bool) -> NamedLayers:
        """Build the model, keep this stage's layers (with their optimizers), resume."""
        cfg = self.cfg
        named = self.build_layers()
        cfg.check_layers(len(named))
        self.ties = prepare_ties(cfg, named)  # tied weights: one copy per holder across stages
        self.resumed = checkpoint.latest_step(self.run_dir) if resume else None
        self.parts = self._resumed_partition(len(named)) or cfg.partition(len(named))
        self.slots, seen = [], set()
        for k in self.my_stages:  # one, or this rank's chunks (interleaved)
            first = sum(self.parts[:k])
            for i in range(first, first + self.parts[k]):
                name, module = named[i]
                module.to(self.device)
                self.slots.append(LayerSlot(i, name, module, self.make_optimizer(
                    owned_parameters(module, seen))))
        self.start = 1 if self.resumed is None else self.resumed + 1
        if hasattr(self.data, "state_dict") and hasattr(self.data, "load_state_dict"):
            self.register_state("data", self.data)
        return named

    def _resumed_partition(self, n_layers: int) -> list[int] | None:
        """The partition the resumed run had reached (a migration may have moved layers),
        when it ran with as many stages as this one."""
        if self.resumed is None:
            return None
        meta = checkpoint.read_meta(self.run_dir, self.resumed)
        parts = meta.get("partition")
        if parts and len(parts) == self.cfg.n_stages and sum(parts) == n_layers:
            return list(parts)
        if parts:
            log.info("checkpoint of step %d was written at pp=%s x dp=%s; this run has "
                     "pp=%d x dp=%d: layers re-partitioned as configured", self.resumed,
                     meta.get("pp"), meta.get("dp"), self.topo.pp, self.topo.dp)
        return None

    def register_state(self, name: str, obj, per_rank: bool = False) -> None:
        """Checkpoint ``obj`` (anything with ``state_dict()`` and ``load_state_dict()``, e.g.
        an LR scheduler or a grad scaler) with the run, and restore it on resume. Register
        in a set-up step (the resumed state is loaded after the last one). ``per_rank``:
        each rank keeps its own (restored only at the same number of ranks); otherwise
        it is the same on every rank and stored once."""
        self.checkpointed[name] = (obj, per_rank)

    def _setup_resume(self) -> None:
        """Last set-up step: parameters, optimizer state (every layer's, sharded ones
        included), registered objects, RNG states and any re-partition still under way,
        from the checkpoint being resumed."""
        if self.resumed is None:
            return
        topo = self.topo
        missing = checkpoint.load_state(self.run_dir, self.resumed, self.stage.slots,
                                        objects=self.checkpointed, rank=topo.rank,
                                        mesh=(topo.pp, topo.dp))
        meta = checkpoint.read_meta(self.run_dir, self.resumed)
        target = meta.get("rebalance_target")
        if self.rebalancer is not None and target and len(target) == topo.pp:
            self.rebalancer.set_target(target, "resumed while re-partitioning")
        if missing and topo.rank == 0:
            log.info("resumed step %d without: %s (%s)", self.resumed, ", ".join(missing),
                     "another pp x dp" if "rng" in missing else "not in the checkpoint")
        log.info("resumed from the checkpoint of step %d", self.resumed)

    def make_optimizer(self, params: list) -> torch.optim.Optimizer | None:
        """The configured optimizer over ``params`` (layers created or moved later too)."""
        return build_optimizer(self.cfg, params)

    def _setup_stage(self, profiler: LayerProfiler) -> None:
        """The activation store, the per-layer profiler and the stage around the layers."""
        cfg, s = self.cfg, self.topo.stage
        self.store, self.profiler = ActivationStore(device=self.device), profiler
        self.stage = Stage(self.slots, self.store, self.profiler, is_first=s == 0,
                           loss_fn=loss_fn(cfg) if cfg.n_stages - 1 in self.my_stages else None,
                           loss_scale=1.0 / cfg.train.micro_batches)
        self.stage.autocast = autocast_factory(cfg.train.precision, self.device)
        self.chunks = chunk_stages(cfg, self.my_stages, self.parts, self.slots, self.store,
                                   self.profiler)
        self.store.chunk_of = {i: k for k, ls in (self.chunk_layers or {}).items() for i in ls}

    def _setup_schedule(self, named: NamedLayers, peer_plan: dict | None, peer_group) -> None:
        """Every stage's action list; the peer-swap actions woven in when planned."""
        cfg, topo = self.cfg, self.topo
        self.schedules = build_schedule(cfg.train.schedule, topo.pp, cfg.train.micro_batches,
                                        cfg.parallel.virtual_stages)
        self.actions, self.extensions = self.schedules[topo.stage], None
        self.peer_plan = peer_plan
        if peer_plan is None and cfg.memory.peer_swap:
            self.peer_plan = self._plan_peer_swap(named)
        if self.peer_plan is not None:
            self.actions, self.extensions = attach_peer_swap(
                self.peer_plan, topo.rank, topo.stage,
                {k: topo.rank_of(k) for k in range(topo.pp)}, self.store, self.schedules,
                cfg.runtime.p2p_timeout_s, group=peer_group)

    def _plan_peer_swap(self, named: NamedLayers) -> dict:
        """The job's peer-swap plan, the same on every rank; rank 0 writes it to the run dir."""
        cfg, t = self.cfg, self.cfg.train
        per_replica = t.batch_size // self.shard[1]
        x, y = self.data.batch(1, t.batch_size)
        sample = (split_microbatches(x[:per_replica], t.micro_batches)[0],
                  split_microbatches(y[:per_replica], t.micro_batches)[0])
        limits = [resolve_limit(v, cfg, self.device) for v in cfg.stage_limits()]
        plan = agree_plan(cfg, named, self.parts, limits, self.topo, self.device, sample)
        if self.topo.rank == 0 and self.outputs:
            atomic_write_text(self.run_dir / "peer_plan.json", json.dumps(plan, indent=1) + "\n")
        return plan

    def _setup_grad_sync(self, grad_sync: GradSync | None) -> None:
        """The gradient exchange across replicas (tied copies summed across stages), told
        which layers this stage holds, and the optimizer step around it (loss-scale check,
        clipping, learning rate)."""
        self.sync = wrap_tied(grad_sync or make_grad_sync(self.cfg, self.topo), self.ties,
                              self.topo, self.stage, self.parts, self.stage_ranks)
        self.sync.attach([slot.module for slot in self.stage.slots])
        self.update = make_update_step(self.cfg, self.sync, self.stage, self.topo, self.start,
                                       self.device)
        if isinstance(self.update, UpdateStep):  # LR schedule and loss scale: in checkpoints
            self.register_state("update", self.update)
            self.update.norm_skip = lambda: duplicate_copies(self.ties, self.stage.slots)

    def _p2p(self, group) -> P2P:
        topo, rt = self.topo, self.cfg.runtime
        return P2P(group, topo.rank, rt.p2p_timeout_s, self.device, topo.describe,
                   on_failure=self._peer_lost)

    def _peer_lost(self, exc: Exception) -> PeerLost | None:
        """Which peer's loss caused ``exc``, when the watchdog knows."""
        if self.watchdog is None:
            return None
        verdict = self.watchdog.verdict(2 * self.cfg.runtime.peer_timeout_s)
        return None if verdict is None else PeerLost(verdict[0], verdict[1])

    def _setup_runtime(self, fault_rank: int | None) -> None:
        """The executor of this stage's actions, talking to its pipeline neighbours."""
        topo, s, f = self.topo, self.topo.stage, self.cfg.fault
        fault = None
        if fault_rank is not None and f.kill_rank == fault_rank:
            fault = kill_self_at(f.kill_step, len(self.actions) // 2, f.kill_before)
        if self.chunks is not None:
            self.runtime = InterleavedRuntime(
                self.stage, self.chunks, self.actions, self._p2p(topo.pp_group),
                rank_of=lambda k: topo.rank_of(self.stage_ranks[k]), grad_sync=self.update,
                replica=topo.replica, rank=s, fault=fault)
            return
        self.runtime = PipelineRuntime(
            self.stage, self.actions, self._p2p(topo.pp_group),
            prev_rank=topo.rank_of(s - 1) if s > 0 else None,
            next_rank=topo.rank_of(s + 1) if s < topo.pp - 1 else None,
            grad_sync=self.update, replica=topo.replica, fault=fault, extensions=self.extensions)

    def _setup_rebalancer(self, named: NamedLayers) -> None:
        """The adaptive pipeline's detector, partitioner, live migration, when anything can move."""
        rb, topo = self.cfg.rebalance, self.topo
        self.rebalancer = self.catalog = self.edit_hook = None
        if not (rb.enabled or rb.at_step or rb.edits):
            return
        self.edit_hook = load_edit_hook(rb.edits) if rb.edits else None
        self.catalog = LayerCatalog(named)
        clusters = _clusters(named) if topo.stage == topo.pp - 1 else []
        self.rebalancer = Rebalancer(self.cfg, topo, self.parts, clusters, self.schedules,
                                     self._p2p(topo.ctrl_group))

    def _setup_memory_budget(self) -> None:
        """The stage's memory budget, planned before step 1 when a limit is set."""
        cfg, s = self.cfg, self.topo.stage
        limit = resolve_limit(cfg.stage_limits()[s], cfg, self.device)
        n_layers = sum(self.parts)
        fixed = cfg.layer_policies(n_layers)
        if self.peer_plan is not None:
            planned = runtime_policies(self.peer_plan)
            fixed = {i: planned.get(i, "keep") for i in range(n_layers)}
        bandwidth = cfg.memory.host_bandwidth
        if not bandwidth and limit is not None and fixed is None:
            bandwidth = measure_host_bandwidth(self.device)
        self.budget = MemoryBudget(self.stage, stage_in_flight(cfg)[s], limit,
                                   cfg.memory.planner, bandwidth, fixed,
                                   chunks=self.chunk_layers)
        if limit is not None and fixed is None:
            self.budget.replan(costs=profile_model(cfg, self.build_layers()),
                               why="before step 1")

    def _setup_telemetry(self, layer_names: list[str]) -> None:
        """Rank 0's recorder: metrics rows, progress bar, trace and report at the end."""
        cfg, topo, t = self.cfg, self.topo, self.cfg.train
        self.trace_events: list = []
        self.pipeline_costs: list[dict] = []
        """Per-layer costs of every stage of the pipeline, refreshed at profile steps."""
        self.recorder = None
        self.mailbox = None if topo.stats_group is None else Mailbox(
            topo.stats_group, topo.rank, topo.world_size)
        """Carries every rank's per-step stats to rank 0 without a collective per step."""
        if topo.rank != 0 or not self.outputs:
            return
        meta = dict(config=cfg.to_dict(), world_size=topo.world_size, pp=topo.pp, dp=topo.dp,
                    schedule=t.schedule, layer_names=layer_names,
                    partition=[[i for i, r in enumerate(self.stage_of) if r == k]
                               for k in range(topo.pp)])
        self.recorder = RunRecorder(self.run_dir, meta, self.stage_of, t.batch_size, t.steps,
                                    self.start, cfg.run.progress)

    @property
    def stage_of(self) -> list[int]:
        """The stage (pipeline rank) of every layer under the current partition."""
        ranks = self.stage_ranks
        return [ranks[k] for k, n in enumerate(self.parts) for _ in range(n)]

    @property
    def my_stages(self) -> list[int]:
        """The model stages this rank runs: its own, or its chunks ``r, r + pp, ...``."""
        return [k for k, r in enumerate(self.stage_ranks) if r == self.topo.stage]

    @property
    def chunk_layers(self) -> dict[int, list[int]] | None:
        """With several chunks per rank: chunk -> its layer indices; else None."""
        if self.chunks is None:
            return None
        return {k: [slot.index for slot in st.slots] for k, st in self.chunks.items()}

    @property
    def stage_ranks(self) -> list[int]:
        """The pipeline rank of every model stage (the identity with one stage per rank)."""
        return stage_ranks(self.cfg.train.schedule, self.topo.pp,
                           self.cfg.parallel.virtual_stages)


def _clusters(named: NamedLayers) -> list[list[int]]:
    """Fork/join clusters of the model (one per layer when the graph cannot be read)."""
    try:
        return model_clusters([m for _, m in named])
    except Exception as exc:  # an opaque layer the tracer cannot read: cut anywhere
        log.warning("could not read the layer graph (%s); every layer is its own cluster",
                    str(exc).splitlines()[0][:200])
        return [[i] for i in range(len(named))]
