"""One rank of a training job: join the process group, build the stage, run the steps.

Runs the same way under ``trainwright run`` (which spawns local ranks with torchrun's
environment variables) and under ``torchrun`` / SLURM directly.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright import checkpoint
from trainwright.build import build_data, build_layers, build_optimizer, loss_fn, split_microbatches
from trainwright.clusters import model_clusters
from trainwright.comm import P2P, Watchdog, exit_now
from trainwright.config import Config, load_config
from trainwright.errors import PeerLost
from trainwright.pipeline.budget import (
    MemoryBudget,
    measure_host_bandwidth,
    profile_model,
    resolve_limit,
    stage_in_flight,
)
from trainwright.pipeline.edit import apply_edits, load_edit_hook
from trainwright.pipeline.peer_setup import agree_plan, runtime_policies
from trainwright.pipeline.peer_setup import attach as attach_peer_swap
from trainwright.pipeline.rebalance import LayerCatalog, Migration
from trainwright.pipeline.repartition import Rebalancer
from trainwright.pipeline.runtime import PipelineRuntime, kill_self_at
from trainwright.pipeline.schedule import build_schedule
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import ActivationStore
from trainwright.profile import LayerProfiler
from trainwright.sync import make_grad_sync
from trainwright.telemetry import RunRecorder, atomic_write_text, setup_logging
from trainwright.topology import Topology

__all__ = ["DistEnv", "run_worker", "train", "resume_hint", "EXIT_PEER_LOST", "EXIT_FAILED"]

log = logging.getLogger(__name__)
EXIT_FAILED = 1
EXIT_PEER_LOST = 3


@dataclass
class DistEnv:
    """The torchrun-style environment of this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool
    """True when the launcher (torchrun's agent or ``trainwright run``) hosts the store."""

    @classmethod
    def from_env(cls) -> DistEnv:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT... from os.environ."""
        e = os.environ
        return cls(rank=int(e["RANK"]), world_size=int(e["WORLD_SIZE"]),
                   local_rank=int(e.get("LOCAL_RANK", 0)),
                   local_world_size=int(e.get("LOCAL_WORLD_SIZE", e["WORLD_SIZE"])),
                   master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(e.get("MASTER_PORT", 29500)),
                   agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    def store(self, timeout_s: float, master: bool = False) -> dist.TCPStore:
        """A client (or, with ``master``, the server) of the rendezvous store."""
        return dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                             is_master=master, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)


def _device(cfg: Config, env: DistEnv) -> tuple[str, torch.device]:
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # the CUDA branch: one device per local rank
        torch.cuda.set_device(env.local_rank)
        return backend, torch.device("cuda", env.local_rank)
    return backend, torch.device("cpu")


def _agree_run_dir(store, env: DistEnv, run_dir: Path | None, cfg: Config) -> Path:
    """Under torchrun every rank parsed the config; rank 0 creates the run dir for all."""
    if run_dir is not None:
        return run_dir
    if env.rank == 0:
        from trainwright.launch import create_run_dir
        run_dir = create_run_dir(cfg)
        store.set("tw/run_dir", str(run_dir.resolve()))
    return Path(store.get("tw/run_dir").decode())


def run_worker(cfg: Config | None, run_dir: Path | None,
               resume: bool = False) -> tuple[int, Path | None]:
    """Train as one rank of the job described by the environment.

    Args:
        cfg: the configuration (None: read ``run_dir/config.toml``).
        run_dir: the run directory (None under torchrun: rank 0 creates one).
        resume: continue from the run directory's latest checkpoint.

    Returns:
        The process exit code (0 on success) and the run directory.
    """
    env = DistEnv.from_env()
    if cfg is None:
        cfg = load_config(Path(run_dir) / "config.toml")
    rt = cfg.runtime
    setup_logging(f"[rank {env.rank} stage {env.rank % cfg.parallel.pp}]",
                  logging.INFO if env.rank == 0 else logging.WARNING)
    threads = cfg.parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    backend, device = _device(cfg, env)
    hosts_store = env.rank == 0 and not env.agent_store
    store = env.store(rt.collective_timeout_s, master=hosts_store)
    run_dir = _agree_run_dir(store, env, run_dir, cfg)
    store_host = -1 if env.agent_store else 0

    once = threading.Lock()

    def lost(rank: int, reason: str) -> None:
        once.acquire()  # the watchdog thread and the main thread may both get here; log once
        who = "the launcher (store host)" if rank < 0 else \
            f"rank {rank} (stage {rank % cfg.parallel.pp}, replica {rank // cfg.parallel.pp})"
        log.error("lost %s: %s. Stopping this rank. %s", who, reason, resume_hint(run_dir))
        exit_now(EXIT_PEER_LOST)

    watchdog = Watchdog(lambda: env.store(rt.peer_timeout_s), env.rank, env.world_size,
                        rt.peer_timeout_s, lost, store_host=store_host).start()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("tw/pg", store), rank=env.rank,
                                world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=rt.collective_timeout_s))
        train(cfg, run_dir, device=device, resume=resume, watchdog=watchdog,
              fault_rank=env.rank)
    except PeerLost as exc:
        lost(exc.rank, str(exc))
    except Exception as exc:
        if _is_comm_failure(exc):  # a collective broke: most likely a peer died; ask who
            verdict = watchdog.verdict(2 * rt.peer_timeout_s)
            if verdict is not None:
                lost(*verdict)
        log.exception("failed: %s", exc)
        watchdog.stop(failed=f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED, run_dir
    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0, run_dir


def resume_hint(run_dir: Path) -> str:
    """How to continue ``run_dir``: from its last checkpoint, or why that is not possible."""
    step = checkpoint.latest_step(run_dir)
    if step is None:
        return "No checkpoint was written yet (see run.checkpoint_every); start again."
    return f"Continue from step {step} with `trainwright run --resume {run_dir}`."


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed transport (gloo, NCCL, the store)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo", "Connection closed", "Connection reset", "NCCL"))


def _peer_lost(watchdog: Watchdog | None, wait_s: float):
    def on_failure(exc: Exception) -> PeerLost | None:
        verdict = watchdog.verdict(wait_s) if watchdog is not None else None
        return None if verdict is None else PeerLost(verdict[0], verdict[1])
    return on_failure


def train(cfg: Config, run_dir: Path, *, device: torch.device | None = None,
          resume: bool = False, watchdog: Watchdog | None = None,
          fault_rank: int | None = None) -> float | None:
    """Run one training job on the already initialised default process group.

    Every rank of the group calls this with the same arguments; it may be called several
    times in one process group (tests do), each call building its own mesh groups.

    Args:
        cfg: the configuration; the group's size must be ``pp * dp``.
        run_dir: where metrics, trace, checkpoints and the report go (rank 0 writes).
        device: where this rank's layers live (default CPU).
        resume: start after the run directory's latest checkpoint.
        watchdog: names a lost peer when a transfer fails (None: report the failure only).
        fault_rank: this process's rank for the ``fault`` testing hooks.

    Returns:
        The last step's mean loss on rank 0, None on other ranks.
    """
    device = device or torch.device("cpu")
    run_dir = Path(run_dir)
    topo = Topology.create(cfg.parallel.pp, cfg.parallel.dp)
    s, t = topo.stage, cfg.train
    named = build_layers(cfg)
    layer_names = [n for n, _ in named]
    cfg.check_layers(len(named))
    parts = cfg.partition(len(named))
    first = sum(parts[:s])
    stage_of = [k for k, n in enumerate(parts) for _ in range(n)]
    rebalancing = cfg.rebalance.enabled or bool(cfg.rebalance.at_step or cfg.rebalance.edits)
    edit_hook = load_edit_hook(cfg.rebalance.edits) if cfg.rebalance.edits else None
    catalog = LayerCatalog(named) if rebalancing else None
    clusters = _clusters(named) if rebalancing and s == topo.pp - 1 else []
    peer_plan = _peer_plan(cfg, named, parts, topo, device, run_dir) if cfg.memory.peer_swap \
        else None
    slots = []
    for i in range(first, first + parts[s]):
        name, module = named[i]
        module.to(device)
        slots.append(LayerSlot(i, name, module, build_optimizer(cfg, list(module.parameters()))))
    del named
    start = 1
    if resume:
        done = checkpoint.latest_step(run_dir)
        if done is not None:
            checkpoint.load_layers(run_dir, done, slots)
            start = done + 1
            log.info("resumed from the checkpoint of step %d", done)
    store, profiler = ActivationStore(device=device), LayerProfiler()
    stage = Stage(slots, store, profiler, is_first=s == 0,
                  loss_fn=loss_fn(cfg) if s == cfg.parallel.pp - 1 else None,
                  loss_scale=1.0 / t.micro_batches)
    schedules = build_schedule(t.schedule, topo.pp, t.micro_batches)
    actions, extensions = schedules[s], None
    if peer_plan is not None:
        actions, extensions = attach_peer_swap(
            peer_plan, topo.rank, s, {k: topo.rank_of(k) for k in range(topo.pp)}, store,
            schedules, cfg.runtime.p2p_timeout_s)
    p2p = P2P(topo.pp_group, topo.rank, cfg.runtime.p2p_timeout_s, device, topo.describe,
              on_failure=_peer_lost(watchdog, cfg.runtime.peer_timeout_s * 2))
    rebalancer = None
    if rebalancing:
        ctrl = P2P(topo.ctrl_group, topo.rank, cfg.runtime.p2p_timeout_s, device, topo.describe,
                   on_failure=_peer_lost(watchdog, cfg.runtime.peer_timeout_s * 2))
        rebalancer = Rebalancer(cfg, topo, parts, clusters, schedules, ctrl)
    sync = make_grad_sync(cfg, topo)
    if hasattr(sync, "watch"):  # sparse sync: learn which parameters are embedding tables
        sync.watch([slot.module for slot in slots])
    fault = None
    if fault_rank is not None and cfg.fault.kill_rank == fault_rank:
        fault = kill_self_at(cfg.fault.kill_step, len(actions) // 2, cfg.fault.kill_before)
    runtime = PipelineRuntime(
        stage, actions, p2p,
        prev_rank=topo.rank_of(s - 1) if s > 0 else None,
        next_rank=topo.rank_of(s + 1) if s < topo.pp - 1 else None,
        grad_sync=sync, replica=topo.replica, fault=fault, extensions=extensions)
    budget = _memory_budget(cfg, stage, s, device, len(layer_names),
                            runtime_policies(peer_plan) if peer_plan is not None else None)
    data = build_data(cfg)
    per_replica = t.batch_size // topo.dp
    lo = topo.replica * per_replica

    recorder = None
    if topo.rank == 0:
        recorder = RunRecorder(
            run_dir, dict(config=cfg.to_dict(), world_size=topo.world_size, pp=topo.pp,
                          dp=topo.dp, schedule=t.schedule, layer_names=layer_names,
                          partition=[list(range(sum(parts[:k]), sum(parts[: k + 1])))
                                     for k in range(topo.pp)]),
            stage_of, t.batch_size, t.steps, start, cfg.run.progress)
    trace_events: list = []
    for step in range(start, t.steps + 1):
        x, y = data.batch(step, t.batch_size)
        x, y = x[lo : lo + per_replica].to(device), y[lo : lo + per_replica].to(device)
        migration = None
        edits = edit_hook(step) if edit_hook is not None else []
        if edits:
            parts, rebalancer.clusters = apply_edits(
                edits, stage=stage, stage_index=s, counts=rebalancer.counts, catalog=catalog,
                clusters=rebalancer.clusters, device=device, seed=t.seed + step,
                make_optimizer=lambda params: build_optimizer(cfg, params))
            rebalancer.counts, rebalancer.target = list(parts), None
            stage_of = [k for k, n in enumerate(parts) for _ in range(n)]
            budget.on_layers_changed()
            if recorder is not None:
                recorder.writer.write("model_edit", step=step, partition=parts,
                                      edits=[repr(e) for e in edits],
                                      layer_names=list(catalog.names))
        if rebalancer is not None:
            ms = rebalancer.migration_for(step)
            if ms is not None:
                migration = Migration(ms, s, stage, rebalancer.ctrl, topo.rank_of, catalog,
                                      lambda params: build_optimizer(cfg, params), device)
        stats = runtime.run_step(step, split_microbatches(x, t.micro_batches) if s == 0 else None,
                                 split_microbatches(y, t.micro_batches) if stage.is_last else None,
                                 trace=step - start < cfg.run.trace_steps, migration=migration)
        if step == start and budget.plan is not None:
            stats.memory_plan = _plan_record(budget, budget.plan)
        if migration is not None:
            old_parts = rebalancer.counts
            rebalancer.step_done()
            stats.migration.update(old=old_parts, new=rebalancer.counts)
            parts = rebalancer.counts
            stage_of = [k for k, n in enumerate(parts) for _ in range(n)]
            if any(s in (m.giver, m.receiver) for m in ms.moves):
                plan = budget.on_layers_changed()  # seed 000: re-plan memory after a move
                if plan is not None:
                    stats.memory_plan = _plan_record(budget, plan)
        trace_events += [(step, *e) for e in stats.events]
        stats.events = []
        profile_now = step % cfg.run.profile_every == 0 or step == t.steps
        check_now = (rebalancer is not None and cfg.rebalance.enabled
                     and step % cfg.rebalance.check_every == 0 and step < t.steps)
        if profile_now or check_now:  # every stage (the last one included) learns the costs
            tables: list = [None] * topo.pp
            dist.all_gather_object(tables, [c.to_dict() for c in profiler.table()],
                                   group=topo.pp_group)
            runtime.pipeline_costs = [c for table in tables for c in table]
        if profile_now and budget.replan(why=f"after step {step}", only_if_over=True) is not None:
            stats.memory_plan = _plan_record(budget, budget.plan)
        if check_now:
            stats.decision = rebalancer.check(step, runtime.pipeline_costs)
        gathered: list | None = [None] * topo.world_size if topo.rank == 0 else None
        dist.gather_object(stats, gathered, dst=0)
        if recorder is not None:
            recorder.stage_of = stage_of
            recorder.step(step, gathered, runtime.pipeline_costs if profile_now else None)
        every = cfg.run.checkpoint_every
        if step == t.steps or (every and step % every == 0):
            _checkpoint(run_dir, step, topo, stage)
    all_events: list | None = [None] * topo.world_size if topo.rank == 0 else None
    dist.gather_object(trace_events, all_events, dst=0)
    if recorder is not None:
        recorder.finish(dict(enumerate(all_events)),
                        {r: topo.describe(r) for r in range(topo.world_size)}, cfg.run.report)
    dist.barrier()
    return recorder.loss if recorder is not None else None


def _memory_budget(cfg: Config, stage: Stage, s: int, device: torch.device,
                   n_layers: int, planned: dict[int, str] | None = None) -> MemoryBudget:
    """The stage's budget, planned before step 1 when a limit is set (``planned``: the
    per-layer policies of a peer-swap plan, fixed)."""
    limit = resolve_limit(cfg.stage_limits()[s], cfg, device)
    fixed = cfg.layer_policies(n_layers)
    if planned is not None:
        fixed = {i: planned.get(i, "keep") for i in range(n_layers)}
    bandwidth = cfg.memory.host_bandwidth
    if not bandwidth and limit is not None and fixed is None:
        bandwidth = measure_host_bandwidth(device)
    budget = MemoryBudget(stage, stage_in_flight(cfg)[s], limit, cfg.memory.planner,
                          bandwidth, fixed)
    if limit is not None and fixed is None:
        budget.replan(costs=profile_model(cfg, build_layers(cfg)), why="before step 1")
    return budget


def _peer_plan(cfg: Config, named: list, parts: list[int], topo: Topology,
               device: torch.device, run_dir: Path) -> dict:
    """The job's seed-004 plan, the same on every rank; rank 0 writes it to the run dir."""
    t = cfg.train
    per_replica = t.batch_size // topo.dp
    x, y = build_data(cfg).batch(1, t.batch_size)
    sample = (split_microbatches(x[:per_replica], t.micro_batches)[0],
              split_microbatches(y[:per_replica], t.micro_batches)[0])
    limits = [resolve_limit(v, cfg, device) for v in cfg.stage_limits()]
    plan = agree_plan(cfg, named, parts, limits, topo, device, sample)
    if topo.rank == 0:
        atomic_write_text(run_dir / "peer_plan.json", json.dumps(plan, indent=1) + "\n")
    return plan


def _clusters(named: list) -> list[list[int]]:
    """Fork/join clusters of the model (one per layer when the graph cannot be read)."""
    try:
        return model_clusters([m for _, m in named])
    except Exception as exc:  # an opaque layer the tracer cannot read: cut anywhere
        log.warning("could not read the layer graph (%s); every layer is its own cluster",
                    str(exc).splitlines()[0][:200])
        return [[i] for i in range(len(named))]


def _plan_record(budget: MemoryBudget, plan) -> dict:
    return {"planner": plan.planner, "reason": plan.reason,
            "required_bytes": plan.required_bytes, "limit_bytes": plan.limit_bytes,
            "added_time_s": plan.added_time_s, "host_bandwidth": budget.host_bandwidth,
            "layers": budget.rows()}


def _checkpoint(run_dir: Path, step: int, topo: Topology, stage: Stage) -> None:
    if topo.replica == 0:
        checkpoint.save_stage(run_dir, step, topo.stage, stage.slots)
    dist.barrier()  # every stage file exists before `latest` moves
    if topo.rank == 0:
        checkpoint.mark_latest(run_dir, step)
        checkpoint.prune(run_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainwright.worker RUN_DIR [--resume]``: one locally spawned rank."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    return run_worker(None, Path(args[0]), resume="--resume" in args)[0]


if __name__ == "__main__":
    exit_now(main())  # the rank is torn down; skip the interpreter shutdown (see exit_now)
