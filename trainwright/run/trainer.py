"""The one trainer: built once from a config in named set-up steps
(:mod:`trainwright.run.trainer_setup`), then one step loop (here).

Every way trainwright trains goes through :class:`Trainer`: a pipeline rank under
``trainwright run`` or torchrun (:mod:`trainwright.run.worker`), a token-ring node
(:mod:`trainwright.run.ring_node`, whose gradient exchange and membership plug in as a
:class:`~trainwright.sync.base.GradSync`), and every benchmark of ours.

One step (:meth:`Trainer.train_step`): apply model edits due now, take the step's
migration if one is planned, run the stage's schedule (forward, backward, ``SYNC`` through
the gradient exchange, ``STEP``), adopt the partition a migration reached and re-plan memory,
at check steps exchange per-layer costs and check for imbalance, record (at profile steps
with this stage's costs), checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.dist.comm import Watchdog
from trainwright.dist.topology import Topology
from trainwright.model.build import build_data, build_layers, split_microbatches
from trainwright.model.text_data import read_share
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.interleaved import InterleavedRuntime
from trainwright.pipeline.rebalance import Migration
from trainwright.pipeline.runtime import StepStats
from trainwright.pipeline.tied import counts_after, expect_partition
from trainwright.run import checkpoint
from trainwright.run.evaluate import check_eval_data, maybe_evaluate
from trainwright.run.trainer_setup import NamedLayers, TrainerSetup
from trainwright.run.update import UpdateStep
from trainwright.sync import GradSync

__all__ = ["Trainer"]


class Trainer(TrainerSetup):
    """One rank's share of a training job.

    Every rank of the job builds one with the same arguments (the default process group
    already initialised, unless ``mesh`` is a single rank without one), then calls
    :meth:`fit`.

    Args:
        cfg: the configuration; the group's size must be ``pp * dp``.
        run_dir: where metrics, trace, checkpoints and the report go (rank 0 writes).
        device: where this rank's layers live (default CPU).
        resume: start after the run directory's latest checkpoint.
        watchdog: names a lost peer when a transfer fails (None: report the failure only).
        fault_rank: this process's rank for the ``fault`` testing hooks.
        mesh: this rank's place in the ``pp x dp`` mesh (default: create the groups).
        layers: builds the whole model as ``(name, layer)`` pairs, the same on every call
            (default: from the config). Called again for profiling copies.
        data: an object with ``batch(step, batch_size) -> (x, y)`` (default: from config).
        grad_sync: the gradient exchange (default: ``sync.strategy`` of the config).
        shard: ``(index, count)``: which share of each global batch this rank's replica
            trains on (default: its data-parallel index and ``dp``). A public attribute: a
            ring node given another index at its rendezvous updates it.
        peer_plan: a peer-swap plan to run (default: planned here when
            ``memory.peer_swap``), and ``peer_group`` the group its chunks travel on.
        profiler: the per-layer cost table (default: smoothed over steps).
        outputs: write metrics, trace, report and checkpoints (a token-ring node writes
            its own report instead).
    """

    def __init__(self, cfg: Config, run_dir: Path | str, *, device: torch.device | None = None,
                 resume: bool = False, watchdog: Watchdog | None = None,
                 fault_rank: int | None = None, mesh: Topology | None = None,
                 layers: Callable[[], NamedLayers] | None = None, data=None,
                 grad_sync: GradSync | None = None, shard: tuple[int, int] | None = None,
                 peer_plan: dict | None = None, peer_group=None,
                 profiler: LayerProfiler | None = None, outputs: bool = True):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device = device or torch.device("cpu")
        self.watchdog, self.outputs = watchdog, outputs
        self._own_mesh, self._fitting = mesh is None, False
        self.topo = mesh or Topology.create(cfg.parallel.pp, cfg.parallel.dp)
        self.build_layers = layers or (lambda: build_layers(cfg))
        self.data = data if data is not None else build_data(cfg)
        if cfg.eval.every:
            check_eval_data(self.data)
        self.shard = shard or (self.topo.replica, self.topo.dp)
        self.checkpointed: dict[str, tuple[object, bool]] = {}
        """Objects whose ``state_dict()`` checkpoints hold (see :meth:`register_state`)."""
        named = self._setup_layers(resume)
        self._setup_stage(profiler or LayerProfiler())
        self._setup_schedule(named, peer_plan, peer_group)
        self._setup_grad_sync(grad_sync)
        self._setup_runtime(fault_rank)
        self._setup_rebalancer(named)
        self._setup_memory_budget()
        self._setup_telemetry([n for n, _ in named])
        self._setup_resume()

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
        if isinstance(self.runtime, InterleavedRuntime):
            self.runtime.flush()
        return self.finish()

    def train_step(self, step: int) -> StepStats | None:
        """One training step on this rank; see the module docstring for its parts."""
        if not self.sync.begin_step(step):
            self.sync.step(self.stage.slots)
            return None
        self._apply_model_edits(step)
        migration = self._migration_for(step)
        x, y = self._batch(step)
        self.stage.fast = self._fast_step(step, migration)
        # a profile step samples every layer's costs on one micro-batch; the rest stay fused
        self.stage.measured_mb = 0 if self.stage.fast and self._profile_step(step) else None
        # a gradient sync may have moved the weights (hierarchical: into its flat buffer)
        self.store.follow_params([slot.module for slot in self.stage.slots])
        m, first = self.cfg.train.micro_batches, self.topo.stage == 0
        stats = self.runtime.run_step(
            step, split_microbatches(x, m) if first else None,
            split_microbatches(y, m) if self.stage.is_last else None,
            trace=step - self.start < self.cfg.run.trace_steps, migration=migration,
            **self._carry(step))
        if step == self.start and self.budget.plan is not None:
            stats.memory_plan = self._plan_record()
        if migration is not None:
            self._after_migration(stats, migration)
        self.trace_events += [(step, *e) for e in stats.events]
        stats.events = []
        costs_fresh = self._profile_and_check(step, stats)
        stats.update = self.update.last if isinstance(self.update, UpdateStep) else {}
        self._record(step, stats, costs_fresh)
        maybe_evaluate(self, step)
        every = self.cfg.run.checkpoint_every
        if self.outputs and (step == self.cfg.train.steps or (every and step % every == 0)):
            self.save_checkpoint(step)
        return stats

    def _carry(self, step: int) -> dict:
        """``carry=True`` when this step may leave its last weight passes and optimizer step
        to the next (``train.carry_weight_grads``, :mod:`trainwright.schedule.carry`):
        inside :meth:`fit`, a fused step before the last and not a profile step (its costs
        go out at its end), dense sync, no tied weights (their ``SYNC`` sums over stages),
        an update that needs no other pipeline rank, no checkpoint or evaluation after it."""
        if not isinstance(self.runtime, InterleavedRuntime):
            return {}
        cfg, ckpt, ev = self.cfg, self.cfg.run.checkpoint_every, self.cfg.eval.every
        return {"carry": bool(
            self._fitting and cfg.train.carry_weight_grads
            and self.stage.fast and self.stage.measured_mb is None
            and step < cfg.train.steps and cfg.sync.strategy == "dense"
            and not self.ties and getattr(self.update, "local", False)
            and not (self.outputs and ckpt and step % ckpt == 0) and not (ev and step % ev == 0))}

    def _fast_step(self, step: int, migration: Migration | None) -> bool:
        """Whether this step may fuse consecutive ``keep`` layers: nothing needs every
        micro-batch's per-layer figures (the first step, memory limits, peer swap,
        rebalancing) and no policy change or migration is pending. A profile step fuses
        too, but for one micro-batch (:attr:`Stage.measured_mb`)."""
        return not (step == self.start
                    or self.budget.limit is not None
                    or self.peer_plan is not None or self.rebalancer is not None
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
        edits = self.edit_hook(step) if self.edit_hook is not None else []
        if not edits:
            return
        self.sync.layers_changing(self.stage.slots)
        self.parts = self.rebalancer.apply_edits(
            edits, stage=self.stage, stage_index=self.topo.stage, catalog=self.catalog,
            device=self.device, seed=self.cfg.train.seed + step,
            make_optimizer=self.make_optimizer)
        self.sync.attach([slot.module for slot in self.stage.slots])
        self.budget.on_layers_changed()
        if self.recorder is not None:
            self.recorder.write("model_edit", step=step, partition=self.parts,
                                edits=[repr(e) for e in edits],
                                layer_names=list(self.catalog.names))

    def _migration_for(self, step: int) -> Migration | None:
        """The live migration this step performs, if the rebalancer planned one."""
        if self.rebalancer is None:
            return None
        ms = self.rebalancer.migration_for(step)
        if ms is None:
            return None
        expect_partition(self.sync, counts_after(self.rebalancer.counts, ms.moves))
        if any(self.topo.stage in (m.giver, m.receiver) for m in ms.moves):
            self.sync.layers_changing(self.stage.slots)  # optimizer state travels with layers
        return Migration(ms, self.topo.stage, self.stage, self.rebalancer.ctrl,
                         self.topo.rank_of, self.catalog, self.make_optimizer, self.device)

    def _after_migration(self, stats: StepStats, migration: Migration) -> None:
        """Adopt the partition the migration reached; re-plan memory if our layers changed."""
        old, self.parts = self.rebalancer.step_done()
        stats.migration.update(old=old, new=self.parts)
        if any(self.topo.stage in (m.giver, m.receiver) for m in migration.plan.moves):
            self.sync.attach([slot.module for slot in self.stage.slots])
            if self.budget.on_layers_changed() is not None:  # re-plan policies after a move
                stats.memory_plan = self._plan_record()

    def _profile_and_check(self, step: int, stats: StepStats) -> bool:
        """At check steps every stage learns every layer's costs and the last stage decides
        whether to re-partition; at profile steps the metrics row gets them and memory is
        re-planned. Returns: a profile step whose costs :meth:`_record` should write."""
        cfg, rb = self.cfg, self.cfg.rebalance
        profile_now = self._profile_step(step)
        check_now = (self.rebalancer is not None and rb.enabled
                     and step % rb.check_every == 0 and step < cfg.train.steps)
        table = [c.to_dict() for c in self.profiler.table()] if profile_now or check_now else None
        if check_now or (profile_now and self.mailbox is None):
            tables = self._all_gather_pipeline(table)
            self.pipeline_costs = [c for table in tables for c in table]
        elif profile_now and self.topo.replica == 0:
            # only rank 0's row needs them: they ride with the stats through the mailbox,
            # and no collective lines the ranks up (one cost 19 ms per profile step here)
            stats.layer_costs = table
        if profile_now and self.budget.replan(why=f"after step {step}",
                                              only_if_over=True) is not None:
            stats.memory_plan = self._plan_record()
        if check_now:
            stats.decision = self.rebalancer.check(step, self.pipeline_costs)
        return profile_now

    def _record(self, step: int, stats: StepStats, costs_fresh: bool) -> None:
        """Every rank's stats to rank 0, which writes the metrics row (with the pipeline's
        per-layer costs at profile steps). Through the mailbox the ranks do not wait for each
        other: rank 0 writes the row when its next row is due (:meth:`RunRecorder.step_later`),
        from the other ranks' stats sent a step earlier."""
        costs = self.pipeline_costs if costs_fresh and stats.layer_costs is None else None
        if self.mailbox is None:
            gathered = self._gather(stats)
            if self.recorder is not None:
                self.recorder.step(step, gathered, costs, self.stage_of)
            return
        self.mailbox.post(stats)
        if self.topo.rank != 0:
            return
        mailbox, world = self.mailbox, self.topo.world_size
        others = lambda: [mailbox.take(r) for r in range(1, world)]  # noqa: E731
        if self.recorder is not None:
            self.recorder.step_later(step, stats, others, costs, list(self.stage_of))
        else:
            others()

    def finish(self) -> float | None:
        """Gather the trace and write the report (rank 0); every rank waits for the end."""
        if self.recorder is not None:
            self.recorder.settle()
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        all_events = self._gather(self.trace_events)
        if self.recorder is not None:
            self.recorder.finish(dict(enumerate(all_events)),
                                 {r: self.topo.describe(r) for r in range(self.topo.world_size)},
                                 self.cfg.run.report)
        if dist.is_initialized():
            coll.barrier()
        return self.recorder.loss if self.recorder is not None else None

    def close(self) -> None:
        """Release the process groups this trainer created (not a ``mesh`` it was given);
        call after :meth:`fit` when the process goes on to build another trainer."""
        if self._own_mesh and dist.is_initialized():
            self.topo.destroy()

    # ------------------------------------------------------------------ helpers
    def _gather(self, obj) -> list | None:
        """``obj`` of every rank on rank 0 (None elsewhere); a lone rank keeps its own."""
        if not dist.is_initialized():
            return [obj]
        out: list | None = [None] * self.topo.world_size if self.topo.rank == 0 else None
        coll.gather_object(obj, out, dst=0)
        return out

    def _all_gather_pipeline(self, obj) -> list:
        """``obj`` of every stage of this rank's pipeline, in stage order."""
        if not dist.is_initialized():
            return [obj]
        out: list = [None] * self.topo.pp
        coll.all_gather_object(out, obj, group=self.topo.pp_group)
        return out

    def _plan_record(self) -> dict:
        plan, budget = self.budget.plan, self.budget
        return {"planner": plan.planner, "reason": plan.reason,
                "required_bytes": plan.required_bytes, "limit_bytes": plan.limit_bytes,
                "added_time_s": plan.added_time_s, "host_bandwidth": budget.host_bandwidth,
                "layers": budget.rows()}

    def save_checkpoint(self, step: int) -> None:
        """Every rank writes its layers' state, RNG states and registered objects (DCP,
        collective); rank 0 then records the partition and moves ``latest``."""
        topo = self.topo
        with self.sync.full_state(self.stage.slots):
            state = checkpoint.layer_state(self.stage.slots)
        state.update(checkpoint.rng_state(topo.rank))
        state.update(checkpoint.extra_state(self.checkpointed, topo.rank))
        checkpoint.save(self.run_dir, step, state)
        if topo.rank == 0:
            target = self.rebalancer.target if self.rebalancer is not None else None
            checkpoint.write_meta(self.run_dir, step, dict(
                pp=topo.pp, dp=topo.dp, world_size=topo.world_size, partition=self.parts,
                rebalance_target=target))
            checkpoint.mark_latest(self.run_dir, step)
            checkpoint.prune(self.run_dir)
