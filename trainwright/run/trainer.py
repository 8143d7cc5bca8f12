"""The one trainer: built from a config in one constructor that reads top to bottom, then
one step loop.

Every way trainwright trains goes through :class:`Trainer`: a pipeline rank under
``trainwright run`` or torchrun (:mod:`trainwright.run.worker`), a token-ring node
(:mod:`trainwright.run.ring_node`, whose gradient exchange and membership plug in as a
:class:`~trainwright.sync.base.GradSync`), and every benchmark of ours.

One step reads in :meth:`Trainer.train_step`, :meth:`Trainer.sync_gradients` and
:meth:`Trainer.update_weights`: the pipeline step runs the stage's schedule (forwards,
backwards and transfers); its ``SYNC`` action syncs the gradients over the replicas and
its ``STEP`` action unscales and clips them, steps the optimizers and the learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.dist.faults import pipeline_fault, save_fault
from trainwright.dist.topology import Topology
from trainwright.model.build import (
    build_data,
    build_layers,
    build_optimizer,
    loss_fn,
    split_microbatches,
)
from trainwright.model.text_data import read_share
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.observe.timing import device_timer
from trainwright.pipeline.interleaved import chunk_stages
from trainwright.pipeline.peer_setup import attach as attach_peer_swap
from trainwright.pipeline.runtime import StepHooks, StepStats
from trainwright.pipeline.stage import Stage, StageOptions, StepMode
from trainwright.pipeline.store import ActivationStore
from trainwright.pipeline.tied import (
    duplicate_copies,
    prepare_ties,
    wrap_tied,
)
from trainwright.rebalance.live import LiveRebalancing
from trainwright.rebalance.migration import Migration
from trainwright.run import checkpoint, manifest
from trainwright.run import trainer_setup as setup
from trainwright.run.ckpt_writer import CheckpointWriter
from trainwright.run.evaluate import check_eval_data, maybe_evaluate
from trainwright.run.precision import autocast_factory
from trainwright.run.records import StepRecords, step_cost
from trainwright.run.trainer_setup import TrainerOptions
from trainwright.run.update import UpdateRules
from trainwright.schedule.actions import build_schedule, stage_ranks
from trainwright.schedule.base import ActionKind
from trainwright.sync import make_grad_sync

__all__ = ["Trainer", "TrainerOptions"]


class Trainer:
    """One rank's share of a training job.

    Every rank of the job builds one with the same arguments (the default process group
    already initialised, unless the mesh is a single rank without one), then calls
    :meth:`fit`.

    Args:
        cfg: the configuration; the group's size must be ``pp * dp``.
        run_dir: where metrics, trace, checkpoints and the report go (rank 0 writes).
        device: where this rank's layers live (default CPU).
        resume: start after the run directory's latest checkpoint.
        options: what the caller supplies instead of the config's defaults
            (:class:`~trainwright.run.trainer_setup.TrainerOptions`).
    """

    def __init__(self, cfg: Config, run_dir: Path | str, *, device: torch.device | None = None,
                 resume: bool = False, options: TrainerOptions | None = None):
        o = options or TrainerOptions()
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device = device or torch.device("cpu")
        self.outputs = o.outputs
        self._own_mesh, self._fitting = o.mesh is None, False
        topo = self.topo = o.mesh or Topology.create(cfg.parallel.pp, cfg.parallel.dp,
                                                    cfg.parallel.mapping)
        self.build_layers = o.layers or (lambda: build_layers(cfg))
        self.data = o.data if o.data is not None else build_data(cfg)
        if cfg.eval.every:
            check_eval_data(self.data)
        self.shard = o.shard or (topo.replica, topo.dp)
        """Which share of each global batch this replica trains on; a ring node given another
        index at its rendezvous updates it."""
        self.checkpointed: dict[str, tuple[object, bool]] = {}
        """Objects whose ``state_dict()`` checkpoints hold (see :meth:`register_state`)."""
        self.stage_ranks = stage_ranks(cfg.train.schedule, topo.pp, cfg.parallel.virtual_stages)
        """The pipeline rank of every model stage (the identity with one stage per rank)."""

        # 1. the model: this rank's layers, each with its own optimizer (so it can migrate)
        named = self.build_layers()
        cfg.check_layers(len(named))
        self.ties = prepare_ties(cfg, named)  # tied weights: one copy per holder across stages
        self.resumed = manifest.resume_step(self.run_dir) if resume else None
        self.start = 1 if self.resumed is None else self.resumed + 1
        self.parts = (setup.resumed_partition(self.run_dir, self.resumed, cfg.n_stages,
                                              len(named), topo)
                      or cfg.partition(len(named)))
        self.slots = setup.place_layers(named, self.parts, self.my_stages, self.device,
                                        self.make_optimizer)
        if hasattr(self.data, "state_dict") and hasattr(self.data, "load_state_dict"):
            # a stateful source's position is where this rank's replica has read to
            self.register_state("data", self.data, per_rank=True)

        # 2. the schedule: every stage's action list
        self.schedules = build_schedule(cfg.train.schedule, topo.pp, cfg.train.micro_batches,
                                        cfg.parallel.virtual_stages)
        self.actions = self.schedules[topo.stage]

        # 3. the update rules (loss scale, clipping, learning rate), checkpointed
        self.rules = UpdateRules(cfg, topo.pp_group, self.start - 1, self.device,
                                 norm_skip=lambda: duplicate_copies(self.ties, self.stage.slots))
        self.register_state("update", self.rules)

        # 4. the stage: its layers, activation store and profiler (one Stage per chunk when
        # the rank runs several), all reading one set of options
        self.store = ActivationStore(device=self.device)
        self.profiler = o.profiler or LayerProfiler()
        self.stage_options = StageOptions(
            autocast=autocast_factory(cfg.train.precision, self.device),
            loss_gradient=self.rules.loss_gradient,
            split_backward=any(a.kind == ActionKind.W for a in self.actions),
            timer=device_timer(self.device, wait=False))  # read at the step's end
        self.stage = Stage(self.slots, self.store, self.profiler, is_first=topo.stage == 0,
                           loss_fn=loss_fn(cfg) if cfg.n_stages - 1 in self.my_stages else None,
                           loss_scale=1.0 / cfg.train.micro_batches, options=self.stage_options)
        self.chunks = chunk_stages(cfg, self.my_stages, self.parts, self.slots, self.store,
                                   self.profiler, self.stage_options)
        self.store.chunk_of = {i: k for k, ls in (self.chunk_layers or {}).items() for i in ls}

        # 5. peer swap: a plan, its actions woven into the schedule, the store's peer
        self.peer_plan, self.peer_swap = o.peer_plan, None
        if self.peer_plan is None and cfg.memory.peer_swap:
            self.peer_plan = setup.plan_peer_swap(
                cfg, named, self.parts, topo, self.device, self.data, self.shard[1],
                self.run_dir if topo.rank == 0 and self.outputs else None)
        if self.peer_plan is not None:
            self.actions, self.peer_swap = attach_peer_swap(
                self.peer_plan, topo.rank, topo.stage,
                {k: topo.rank_of(k) for k in range(topo.pp)}, self.store, self.schedules,
                cfg.runtime.p2p_timeout_s, group=o.peer_group)

        # 6. the gradient exchange across replicas (tied copies summed across stages), and
        # how its synced gradients become weights
        self.sync = wrap_tied(o.grad_sync or make_grad_sync(cfg, topo), self.ties, topo,
                              self.stage, self.parts, self.stage_ranks)
        self.sync.attach([slot.module for slot in self.stage.slots])
        self.weights = self.sync.weight_update(self.stage)
        self.last_update: dict = {}
        """What the last optimizer step did (``lr``, ``grad_norm``, ``loss_scale``...)."""

        # 7. the runtime: the executor of this rank's actions, talking to its neighbours;
        # its SYNC and STEP call sync_gradients and update_weights (below)
        self.p2p = setup.P2PFactory(topo, cfg.runtime, self.device, o.watchdog)
        self.runtime = setup.make_runtime(
            self.stage, self.chunks, self.actions, self.p2p(topo.pp_group), topo,
            self.stage_ranks, StepHooks(sync=self.sync_gradients, update=self.update_weights),
            fault=pipeline_fault(cfg.fault, o.fault_rank, self.actions), peer=self.peer_swap)

        # 8. the memory budget, planned before step 1 when a limit is set
        self.budget = setup.memory_budget(cfg, self.stage, topo.stage, self.device,
                                          sum(self.parts), self.peer_plan, self.chunk_layers,
                                          self.build_layers)

        # 9. rebalancing: model edits and live migrations, when layers can move
        rb = cfg.rebalance
        self.rebalancing = None
        if rb.enabled or rb.at_step or rb.edits:
            self.rebalancing = LiveRebalancing(
                cfg, topo, named, self.parts, self.schedules, self.p2p(topo.ctrl_group),
                stage=self.stage, sync=self.sync, budget=self.budget,
                make_optimizer=self.make_optimizer, device=self.device)

        # 10. telemetry: rank 0 records metrics, trace and report
        self.trace_events: list = []
        self.pipeline_costs: list[dict] = []
        """Per-layer costs of every stage of the pipeline, refreshed at profile steps."""
        self.records = StepRecords(cfg, topo, self.run_dir, [n for n, _ in named],
                                   self.stage_of, self.start, self.outputs,
                                   cost=lambda: step_cost(cfg, self.build_layers, self.data,
                                                          self.device, topo.world_size))

        # 11. checkpoints (in the background with run.async_checkpoint); then the resumed
        # state, once everything that holds some exists
        self.checkpoints = CheckpointWriter(self.run_dir, topo.rank, cfg.run.async_checkpoint,
                                            save_fault(cfg.fault, o.fault_rank), clean=resume)
        if self.resumed is not None:
            setup.load_resumed(self.run_dir, self.resumed, self.stage.slots, self.checkpointed,
                               topo, self.rebalancing.rebalancer if self.rebalancing else None)

    def make_optimizer(self, params: list) -> torch.optim.Optimizer | None:
        """The configured optimizer over ``params`` (layers created or moved later too)."""
        return build_optimizer(self.cfg, params)

    def register_state(self, name: str, obj, per_rank: bool = False) -> None:
        """Checkpoint ``obj`` (anything with ``state_dict()`` and ``load_state_dict()``, e.g.
        an LR scheduler or a grad scaler) with the run, and restore it on resume. Register
        while building (the resumed state is loaded at the end of the constructor).
        ``per_rank``: each rank keeps its own (restored only at the same number of ranks);
        otherwise it is the same on every rank and stored once."""
        self.checkpointed[name] = (obj, per_rank)

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

    # ------------------------------------------------------------------ the step loop
    def fit(self, on_step: Callable[[int, StepStats | None], None] | None = None,
            start: int | None = None) -> float | None:
        """Train from the start step through ``train.steps``.

        Args:
            on_step: called after every step with its number and this rank's stats
                (None for a step the gradient exchange told this rank to skip). Under ZB-V
                with ``train.carry_weight_grads`` a rank may run a step's last weight passes
                and its optimizer step at the start of the next one, so ``on_step`` sees
                that rank's weights one update behind; everything after ``fit`` (and every
                checkpoint and evaluation) sees them complete.
            start: the first step (default: 1, or the one after a resumed checkpoint; a
                ring node that rejoined continues after the step its welcome brought).

        Returns:
            The last step's mean loss on rank 0, None on other ranks.
        """
        step = self.start if start is None else start
        self._fitting = True  # steps follow each other: one may carry work into the next
        try:
            while step <= self.cfg.train.steps:
                stats = self.train_step(step)
                if on_step is not None:
                    on_step(step, stats)
                step = self.sync.applied_through(step) + 1
        finally:
            self._fitting = False
        self.runtime.flush()  # a step's carried passes (interleaved schedules)
        return self.finish()

    def train_step(self, step: int) -> StepStats | None:
        """One training step on this rank.

        In order: the model edits and live migration due now; this replica's share of the
        batch; the pipeline step, whose ``SYNC`` action calls :meth:`sync_gradients` and
        whose ``STEP`` action calls :meth:`update_weights`; then what follows a step
        (adopting a migration's partition, profiling and imbalance checks, the metrics row,
        evaluation, a checkpoint).
        """
        if not self.sync.begin_step(step):  # the token ring closed this step without us
            self.update_weights()
            return None
        self._apply_model_edits(step)
        migration = (self.rebalancing.migration_for(step) if self.rebalancing is not None
                     else None)
        x, y = self._batch(step)
        fast = self._fast_step(step, migration)
        # a profile step samples every layer's costs on one micro-batch; the rest stay fused
        self.stage_options.mode = StepMode(
            fast=fast, measured_mb=0 if fast and self._profile_step(step) else None)
        # a gradient sync may have moved the weights (hierarchical: into its flat buffer)
        self.store.follow_params([slot.module for slot in self.stage.slots])
        m, first = self.cfg.train.micro_batches, self.topo.stage == 0
        stats = self.runtime.run_step(  # the pipeline step: SYNC and STEP run below
            step, split_microbatches(x, m) if first else None,
            split_microbatches(y, m) if self.stage.is_last else None,
            trace=step - self.start < self.cfg.run.trace_steps, migration=migration,
            carry=self._carry(step))
        if step == self.start and self.budget.plan is not None:
            stats.memory_plan = self.budget.record()
        if stats.cuda_activation_peak_bytes is not None and \
                self.budget.check_allocator(stats.cuda_activation_peak_bytes, step) is not None:
            stats.memory_plan = self.budget.record()
        if migration is not None:
            self._after_migration(stats, migration)
        self.trace_events += [(step, *e) for e in stats.events]
        stats.events = []
        costs_fresh = self._profile_and_check(step, stats)
        stats.update = self.last_update
        self._record(step, stats, costs_fresh)
        maybe_evaluate(self, step)
        every = self.cfg.run.checkpoint_every
        if self.outputs and (step == self.cfg.train.steps or (every and step % every == 0)):
            self.save_checkpoint(step)
        return stats

    def sync_gradients(self, layers_moved: bool = False) -> None:
        """The schedule's ``SYNC``: average the gradients over the replicas (tied copies
        then summed over the stages holding them). ``layers_moved``: a migration changed
        the stage's layers in this step, and the exchange learns them first."""
        if layers_moved:
            self.sync.attach([slot.module for slot in self.stage.slots])
        self.sync.sync(self.stage.parameters())

    def update_weights(self) -> None:
        """The schedule's ``STEP``: unscale (fp16) and clip the synced gradients, step the
        optimizers, step the learning rate. What it did goes into the step's stats."""
        rules, opts = self.rules, self.weights.optimizers()
        record = {"lr": rules.lr.lr}
        if rules.unscale_and_agree(opts, record):  # fp16 overflow: every rank skips
            self.weights.skip()
        else:
            rules.clip(self.stage.parameters(), self.sync.grad_shard, record)
            rules.lr.apply(opts)
            self.weights.step()
        rules.advance()
        self.last_update = record

    def _carry(self, step: int) -> bool:
        """Whether this step may leave its last weight passes and optimizer step to the next
        (``train.carry_weight_grads``, :mod:`trainwright.schedule.carry`): an interleaved
        schedule, inside :meth:`fit`, a fused step before the last and not a profile step
        (its costs go out at its end), dense sync, no tied weights (their ``SYNC`` sums over
        stages), an update that needs no other pipeline rank, no checkpoint or evaluation
        after it."""
        cfg, ckpt, ev = self.cfg, self.cfg.run.checkpoint_every, self.cfg.eval.every
        return bool(
            self.chunks is not None and self._fitting and cfg.train.carry_weight_grads
            and self.stage.fast and self.stage.measured_mb is None
            and step < cfg.train.steps and cfg.sync.strategy == "dense"
            and not self.ties and self.rules.local
            and not (self.outputs and ckpt and step % ckpt == 0) and not (ev and step % ev == 0))

    def _fast_step(self, step: int, migration: Migration | None) -> bool:
        """Whether this step may fuse consecutive ``keep`` layers: nothing needs every
        micro-batch's per-layer figures (the first step, memory limits, peer swap,
        rebalancing) and no policy change or migration is pending. A profile step fuses
        too, but for one micro-batch (:attr:`Stage.measured_mb`)."""
        return not (step == self.start
                    or self.budget.limit is not None
                    or self.peer_plan is not None or self.rebalancing is not None
                    or migration is not None)

    def _profile_step(self, step: int) -> bool:
        """Every ``run.profile_every``-th step measures and exchanges per-layer costs; so does
        the last step of a run that had none after its first (a short run's report and
        plan then read warm costs). A long run's last step stays fused: it is one of
        its ordinary steps, not a profile step more."""
        every, last = self.cfg.run.profile_every, self.cfg.train.steps
        return step % every == 0 or (step == last and last // every * every < self.start)

    def _batch(self, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This replica's share of the step's global batch, on the device: the inputs on the
        first stage, the targets on the last (None where the stage needs none)."""
        x, y = read_share(self.data, step, self.cfg.train.batch_size, *self.shard,
                          inputs=self.topo.stage == 0, targets=self.stage.is_last)
        return tuple(None if t is None else t.to(self.device) for t in (x, y))

    def _apply_model_edits(self, step: int) -> None:
        """Insert or remove layers as the config's edit hook asks for this step."""
        edits = self.rebalancing.apply_edits(step) if self.rebalancing is not None else None
        if edits is None:
            return
        self.parts = list(self.rebalancing.rebalancer.counts)
        self.records.write("model_edit", step=step, partition=self.parts,
                           edits=[repr(e) for e in edits],
                           layer_names=list(self.rebalancing.catalog.names))

    def _after_migration(self, stats: StepStats, migration: Migration) -> None:
        """Adopt the partition the migration reached (memory re-planned if our layers
        changed)."""
        old, self.parts, replanned = self.rebalancing.adopt(migration)
        stats.migration.update(old=old, new=self.parts)
        if replanned:
            stats.memory_plan = self.budget.record()

    def _profile_and_check(self, step: int, stats: StepStats) -> bool:
        """At check steps every stage learns every layer's costs and the last stage decides
        whether to re-partition; at profile steps the metrics row gets them and memory is
        re-planned. Returns: a profile step whose costs :meth:`_record` should write."""
        cfg, rb = self.cfg, self.cfg.rebalance
        profile_now = self._profile_step(step)
        check_now = (self.rebalancing is not None and rb.enabled
                     and step % rb.check_every == 0 and step < cfg.train.steps)
        table = [c.to_dict() for c in self.profiler.table()] if profile_now or check_now else None
        if check_now or (profile_now and self.records.needs_collective):
            tables = coll.all_gather_objects(table, self.topo.pp, self.topo.pp_group)
            self.pipeline_costs = [c for table in tables for c in table]
        elif profile_now and self.topo.replica == 0:
            # only rank 0's row needs them: they ride with the stats through the mailbox,
            # and no collective lines the ranks up (one cost 19 ms per profile step here)
            stats.layer_costs = table
        if profile_now and self.budget.replan(why=f"after step {step}",
                                              only_if_over=True) is not None:
            stats.memory_plan = self.budget.record()
        if check_now:
            stats.decision = self.rebalancing.rebalancer.check(step, self.pipeline_costs)
        return profile_now

    def _record(self, step: int, stats: StepStats, costs_fresh: bool) -> None:
        """Every rank's stats to rank 0 (with the pipeline's per-layer costs at profile
        steps), which writes the metrics row."""
        costs = self.pipeline_costs if costs_fresh and stats.layer_costs is None else None
        self.records.step(step, stats, costs, self.stage_of)

    def finish(self) -> float | None:
        """Wait for the last checkpoint save, gather the trace and write the report (rank 0);
        every rank waits for the end."""
        self.checkpoints.wait()
        return self.records.finish(self.trace_events)

    def close(self) -> None:
        """Release the process groups this trainer created (not a ``mesh`` it was given);
        call after :meth:`fit` when the process goes on to build another trainer."""
        self.checkpoints.close()
        if self._own_mesh and dist.is_initialized():
            self.topo.destroy()

    def save_checkpoint(self, step: int) -> None:
        """Every rank writes its layers' state (the exchange's sharded state gathered first),
        RNG states and registered objects; rank 0 then records the partition and completes
        the checkpoint (in the background with ``run.async_checkpoint``)."""
        with self.sync.full_state(self.stage.slots):
            layers = checkpoint.layer_state(self.stage.slots)
        target = self.rebalancing.rebalancer.target if self.rebalancing else None
        state = checkpoint.rank_state(layers, self.checkpointed, self.topo.rank)
        self.checkpoints.save(step, state, checkpoint.checkpoint_meta(self.topo, self.parts,
                                                                      target))
