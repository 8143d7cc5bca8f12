"""Peer pipeline systems that train the shared benchmark workload, for side-by-side timing.

Each peer trains exactly :class:`~trainwright.bench.spec.PipelineBenchSpec`'s workload (same
layers, same initial weights, same split, same micro-batches, same SGD, same data) so that
``trainwright bench pipeline`` can put its step times next to ours:

- :func:`torch_pipelining_worker` -- ``torch.distributed.pipelining`` with manual
  ``PipelineStage``\\ s and ``Schedule1F1B`` (system ``"torch_pipelining_1f1b"``);
- DeepSpeed's pipeline engine, in :mod:`trainwright.bench.deepspeed_peer` (same result
  format, launched with :func:`spawn_peer` too).

A worker runs in one spawned process per rank (see :func:`spawn_peer`) and writes one JSON
file per rank::

    {"system": str, "rank": int, "step_times_s": [float, ...],
     "losses": [float, ...] | None,     # per step, mean over micro-batches; last stage only
     "params_checksum": float}          # sum of every parameter of the rank's stage

plus ``<out_path>.pt``: the stage's final parameters keyed as in
``nn.Sequential(*spec.layers()).state_dict()`` (global layer index first), so a test can
compare them tensor by tensor with a single-process reference.

Loss scaling (numerics match a single process that backpropagates
``loss_mb / micro_batches`` for every micro-batch):

- torch pipelining: since torch 2.7 (pytorch#144352) the schedules take
  ``scale_grads=True`` by default and *divide every gradient by n_microbatches* after the
  last backward, so a ``loss_fn`` returning the plain per-micro-batch mean is right there;
  torch 2.4-2.6 did no scaling at all. To be the same on every version this module passes
  ``scale_grads=False`` where the argument exists and divides the loss by
  ``micro_batches`` inside ``loss_fn`` (which is also what the reference does, and saves a
  pass over the gradients); the step's loss is then the sum of the losses the schedule
  hands back. Do not record losses inside ``loss_fn``: in torch 2.13 the first ``step``
  also calls it once for shape inference, on placeholder tensors of arbitrary values
  (a NaN loss here).
- DeepSpeed: see :mod:`trainwright.bench.deepspeed_peer`.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainwright.bench.spec import PipelineBenchSpec
from trainwright.dist import collective as coll
from trainwright.dist.ports import free_port

__all__ = [
    "PG_TIMEOUT_S",
    "init_process_group",
    "WorkerFn",
    "torch_pipelining_worker",
    "torch_pipelining_train",
    "TORCH_SCHEDULES",
    "torch_stage_ids",
    "chunk_split",
    "torch_system_name",
    "spawn_peer",
    "free_port",
    "step_time_s",
]

logger = logging.getLogger(__name__)

PG_TIMEOUT_S = 300.0
"""Deadline of every gloo operation (and of the rendezvous) inside a peer worker."""

WorkerFn = Callable[[int, int, int, PipelineBenchSpec, str], None]
"""``worker(rank, world_size, master_port, spec, out_path)``, run once per rank."""

_MASTER_ADDR = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# helpers shared by the workers


def init_process_group(rank: int, world_size: int, master_port: int) -> None:
    """Join the gloo group of the peer on 127.0.0.1 with a deadline."""
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{_MASTER_ADDR}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )


def _check_world(spec: PipelineBenchSpec, world_size: int) -> None:
    """Raise unless there is exactly one rank per pipeline stage."""
    if world_size != len(spec.split):
        raise ValueError(
            f"a peer pipeline runs one rank per stage: world_size={world_size} but "
            f"split={spec.split} has {len(spec.split)} stages"
        )
    if sum(spec.split) != spec.n_blocks + 2:
        raise ValueError(
            f"split={spec.split} covers {sum(spec.split)} layers, the model has "
            f"{spec.n_blocks + 2} (embedding, {spec.n_blocks} blocks, head)"
        )


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The workload's loss: token-level cross entropy, mean over the micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _stage_state(layers: list[nn.Module], start: int) -> dict[str, torch.Tensor]:
    """Parameters of a stage keyed like ``nn.Sequential(*spec.layers()).state_dict()``."""
    state: dict[str, torch.Tensor] = {}
    for offset, layer in enumerate(layers):
        for name, tensor in layer.state_dict().items():
            state[f"{start + offset}.{name}"] = tensor.detach().clone()
    return state


def _write_result(
    out_path: str,
    *,
    system: str,
    rank: int,
    step_times: list[float],
    losses: list[float] | None,
    layers: list[nn.Module],
    start: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the rank's JSON result and its stage parameters (``out_path + ".pt"``)."""
    params = [p for layer in layers for p in layer.parameters()]
    checksum = float(sum(p.detach().double().sum().item() for p in params))
    result: dict[str, Any] = {
        "system": system,
        "rank": rank,
        "step_times_s": step_times,
        "losses": losses,
        "params_checksum": checksum,
        **(extra or {}),
    }
    torch.save(_stage_state(layers, start), out_path + ".pt")
    Path(out_path).write_text(json.dumps(result))


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a parameter called ``name`` (APIs differ between torch versions)."""
    return name in inspect.signature(fn).parameters


# --------------------------------------------------------------------------------------------
# torch.distributed.pipelining


TORCH_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                   "DualPipeV")
"""torch pipelining schedules the benchmark runs (``Schedule<name>``); all but 1F1B hold two
model chunks per rank."""

V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Schedules that place chunks in a V: rank ``r`` holds stages ``r`` and ``2w - 1 - r``."""


def torch_stage_ids(schedule: str, rank: int, world_size: int) -> list[int]:
    """The pipeline stages rank ``rank`` holds under torch's ``schedule``."""
    if schedule in ("1F1B", "GPipe"):
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * world_size - 1 - rank]
    return [rank, rank + world_size]


def chunk_split(split: list[int], chunks_per_stage: int) -> list[int]:
    """Cut the model ``[embed, blocks..., head]`` into ``len(split) * chunks_per_stage``
    chunks holding equal numbers of blocks, the embedding joining the first chunk and the
    head the last: ``[5, 5]`` by 2 -> ``[3, 2, 2, 3]``.

    This is how a user of a multi-chunk schedule balances it. Looped placement (chunks
    ``r`` and ``r + p`` on rank ``r``) then gives every rank the blocks it has under
    ``split``; V-shaped placement (chunks ``r`` and ``2p - 1 - r``) gives rank 0 the same
    blocks plus the embedding and the head. Cutting each stage of ``split`` in two instead
    (``[3, 2, 3, 2]``) would put 5 blocks on one rank and 3 on the other.

    With fewer blocks than chunks (tiny test models) each stage of ``split`` is cut in
    ``chunks_per_stage`` runs of layers instead.
    """
    n = len(split) * chunks_per_stage
    blocks = sum(split) - 2
    if blocks >= n:
        base, extra = divmod(blocks, n)
        return [base + (i < extra) + (i == 0) + (i == n - 1) for i in range(n)]
    out = []
    for layers in split:
        base, extra = divmod(layers, chunks_per_stage)
        out += [base + (i < extra) for i in range(chunks_per_stage)]
    if min(out) < 1:
        raise ValueError(f"split {split} has a stage with fewer than {chunks_per_stage} layers")
    return out


def torch_pipelining_worker(
    rank: int, world_size: int, master_port: int, spec: PipelineBenchSpec, out_path: str,
    schedule: str = "1F1B",
) -> None:
    """Train the benchmark workload with a ``torch.distributed.pipelining`` schedule on one rank.

    With ``Schedule1F1B`` stage ``rank`` holds ``spec.stage_layers(rank)``; the multi-chunk
    schedules cut the model in ``2 * world_size`` chunks of equal blocks (:func:`chunk_split`:
    4 stages on 2 ranks, placed by :func:`torch_stage_ids`), so each rank holds the blocks
    it holds in 1F1B. Each chunk is an ``nn.Sequential`` in a manual
    ``PipelineStage`` (the first takes the token ids, the last returns logits), with
    ``spec.micro_batches`` micro-batches and plain SGD. Each step's time is taken with
    ``time.perf_counter()`` from just after a barrier to after ``optimizer.step()``.

    Args:
        rank: this process's rank.
        world_size: number of ranks; must equal ``len(spec.split)``.
        master_port: TCP port of the gloo rendezvous on 127.0.0.1.
        spec: the workload.
        out_path: where to write this rank's JSON result (and ``out_path + ".pt"``).
        schedule: one of :data:`TORCH_SCHEDULES`.
    """
    torch.set_num_threads(spec.threads_per_rank)
    _check_world(spec, world_size)
    init_process_group(rank, world_size, master_port)
    try:
        result, state = torch_pipelining_train(rank, world_size, spec, schedule)
        torch.save(state, out_path + ".pt")
        Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def torch_pipelining_train(rank: int, world_size: int, spec: PipelineBenchSpec,
                           schedule: str = "1F1B", clock: str = "step") -> tuple[dict, dict]:
    """The body of :func:`torch_pipelining_worker` in an initialised process group.

    ``clock="step"`` puts a barrier before every step and times each; ``"run"`` puts one
    after the ``spec.warmup`` steps only and times the rest back to back (``run_s``: from
    leaving it to this rank's last ``optimizer.step``), as a training loop runs them.

    Returns:
        This rank's result (see the module docstring) and its final parameters.
    """
    import torch.distributed.pipelining as tpp

    ids_here = torch_stage_ids(schedule, rank, world_size)
    parts = spec.split if len(ids_here) == 1 else chunk_split(spec.split, 2)
    n_stages = len(parts)
    layers_all = spec.layers()
    chunks = {sid: (sum(parts[:sid]), layers_all[sum(parts[:sid]): sum(parts[: sid + 1])])
              for sid in ids_here}
    modules = {sid: nn.Sequential(*ls) for sid, (_, ls) in chunks.items()}
    stages = [tpp.PipelineStage(modules[sid], sid, n_stages, torch.device("cpu"))
              for sid in ids_here]
    has_first, has_last = 0 in ids_here, n_stages - 1 in ids_here
    n_mb = spec.micro_batches

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # gradients of the full-batch mean loss; see the module docstring
        return _mean_loss(logits, targets) / n_mb

    cls = getattr(tpp, f"Schedule{schedule}")
    kwargs: dict[str, Any] = {"n_microbatches": n_mb, "loss_fn": loss_fn}
    if _accepts(cls.__init__, "scale_grads"):
        kwargs["scale_grads"] = False
    sched = cls(stages[0] if len(stages) == 1 else stages, **kwargs)
    step_kwargs: dict[str, Any] = {}
    if _accepts(sched.step, "return_outputs"):
        step_kwargs["return_outputs"] = False
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    data = spec.data()

    step_times: list[float] = []
    losses: list[float] = []
    run_t0 = run_s = 0.0
    for step in range(spec.steps):
        ids, targets = data.batch(step + 1, spec.batch_size)  # steps are 1-based
        mb_losses: list[torch.Tensor] = []
        if clock == "step" or step == spec.warmup:
            coll.barrier()
        t0 = time.perf_counter()
        if step == spec.warmup:
            run_t0 = t0
        optimizer.zero_grad()
        inputs = (ids,) if has_first else ()
        if has_last:
            sched.step(*inputs, target=targets, losses=mb_losses, **step_kwargs)
        else:
            sched.step(*inputs, **step_kwargs)
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        run_s = time.perf_counter() - run_t0 if step >= spec.warmup else 0.0
        if has_last:  # each entry is loss_mb / micro_batches: the sum is the mean
            losses.append(torch.stack(mb_losses).sum().item())
        logger.debug("torch pipelining rank %d step %d: %.3f s", rank, step, step_times[-1])

    state = {k: v for start, ls in chunks.values() for k, v in _stage_state(ls, start).items()}
    checksum = float(sum(p.detach().double().sum().item() for p in params))
    return {"system": torch_system_name(schedule), "rank": rank, "step_times_s": step_times,
            "run_s": run_s, "run_steps": spec.steps - spec.warmup, "clock": clock,
            "losses": losses if has_last else None, "params_checksum": checksum}, state


def torch_system_name(schedule: str) -> str:
    """The benchmark's name of a torch pipelining schedule (``"1F1B"`` -> the historic
    ``"torch_pipelining_1f1b"``)."""
    return "torch_pipelining_" + ("1f1b" if schedule == "1F1B" else schedule)


# --------------------------------------------------------------------------------------------
# launching


def _system_name(worker_fn: Callable[..., Any], worker_kwargs: dict[str, Any]) -> str:
    """The system a worker runs: its ``system_name(**worker_kwargs)`` where it has one (the
    DeepSpeed worker does), else its function name."""
    inner = getattr(worker_fn, "func", worker_fn)
    if inner is torch_pipelining_worker:
        return torch_system_name(worker_kwargs.get("schedule", "1F1B"))
    if callable(getattr(inner, "system_name", None)):
        return inner.system_name(**worker_kwargs)
    return str(getattr(inner, "__name__", repr(worker_fn)))


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this rank when the process that spawned it is gone (killed bench, closed shell):
    an orphaned rank would otherwise run the rest of an hour-long plan on its own.

    The parent is the one multiprocessing recorded at spawn, not ``os.getppid()`` now: a
    parent that died while this rank was still importing torch would read as init."""
    import multiprocessing

    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("bench rank: parent process %d is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _rank_entry(
    rank: int,
    worker_fn: Callable[..., None],
    world_size: int,
    master_port: int,
    spec: PipelineBenchSpec,
    out_dir: str,
    worker_kwargs: dict[str, Any],
) -> None:
    """Spawn target: run ``worker_fn`` for ``rank`` with its own output file."""
    _exit_with_parent()
    worker_fn(
        rank,
        world_size,
        master_port,
        spec,
        os.path.join(out_dir, f"rank{rank}.json"),
        **worker_kwargs,
    )


def spawn_peer(
    worker_fn: Callable[..., None],
    spec: PipelineBenchSpec,
    world_size: int = 2,
    timeout_s: float = 600,
    *,
    worker_kwargs: dict[str, Any] | None = None,
    with_state: bool = False,
) -> list[dict[str, Any]]:
    """Run a peer worker on ``world_size`` spawned processes and collect their results.

    The ranks meet on a free port of 127.0.0.1. Every rank must exit cleanly before
    ``timeout_s``; otherwise every rank still alive is killed.

    Args:
        worker_fn: a module-level worker such as :func:`torch_pipelining_worker`.
        spec: the workload.
        world_size: ranks to spawn (one per stage).
        timeout_s: deadline for the whole run, start-up included.
        worker_kwargs: extra keyword arguments for ``worker_fn`` (e.g.
            ``{"activation_checkpointing": True}`` for :func:`deepspeed_worker`).
        with_state: also load each rank's final stage parameters into ``result["state"]``.

    Returns:
        One result dict per rank, in rank order (see the module docstring).

    Raises:
        RuntimeError: a rank failed or the deadline passed; the message names the system.
    """
    import torch.multiprocessing as mp

    worker_kwargs = dict(worker_kwargs or {})
    system = _system_name(worker_fn, worker_kwargs)
    out_dir = tempfile.mkdtemp(prefix=f"trainwright-{system}-")
    try:
        port = free_port()
        logger.info("spawning %s on %d ranks, port %d", system, world_size, port)
        context = mp.start_processes(
            _rank_entry,
            args=(worker_fn, world_size, port, spec, out_dir, worker_kwargs),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks still running after {timeout_s:.0f} s")
        except Exception as err:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in context.processes:
                proc.join(timeout=10)
            raise RuntimeError(f"peer system {system!r} failed: {err}") from err

        results: list[dict[str, Any]] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            try:
                result = json.loads(Path(path).read_text())
            except (OSError, ValueError) as err:
                raise RuntimeError(
                    f"peer system {system!r}: rank {rank} exited without a result ({err})"
                ) from err
            if with_state:
                result["state"] = torch.load(path + ".pt", weights_only=True)
            results.append(result)
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def step_time_s(results: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per-step time of a peer run: the slowest rank's time of each step after ``warmup``.

    Args:
        results: what :func:`spawn_peer` returned.
        warmup: leading steps to leave out.

    Returns:
        One time per timed step (take the median for the benchmark's figure).
    """
    per_rank = [r["step_times_s"][warmup:] for r in results]
    if not per_rank or not per_rank[0]:
        return []
    return [max(times) for times in zip(*per_rank, strict=True)]
