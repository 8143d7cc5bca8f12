"""Peer pipeline systems that train the shared benchmark workload, for side-by-side timing.

Each peer trains exactly :class:`~trainwright.bench.spec.PipelineBenchSpec`'s workload (same
layers, same initial weights, same split, same micro-batches, same SGD, same data) so that
``trainwright bench pipeline`` can put its step times next to ours:

- :func:`torch_pipelining_worker` -- ``torch.distributed.pipelining`` with manual
  ``PipelineStage``\\ s and ``Schedule1F1B`` (system ``"torch_pipelining_1f1b"``);
- :func:`deepspeed_worker` -- DeepSpeed's ``PipelineModule`` / ``PipelineEngine``
  (system ``"deepspeed_pipeline"``, or ``"deepspeed_pipeline_ckpt"`` with activation
  checkpointing of the transformer blocks). DeepSpeed is the optional extra ``bench``;
  this module imports without it and :func:`deepspeed_available` tells whether it is there.

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
- DeepSpeed: ``engine.backward`` divides the loss by ``gradient_accumulation_steps`` itself
  (``scale_wrt_gas=True``) and ``train_batch`` returns the mean over micro-batches, so its
  ``loss_fn`` returns the plain mean.

DeepSpeed on CPU: the worker forces ``DS_ACCELERATOR=cpu`` and gloo. On start DeepSpeed's
communication backend JIT-compiles its shared-memory all-reduce op (``deepspeed_shm_comm``,
used only by ``inference_all_reduce``, never by pipeline training) for 40-50 s into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``). The worker marks that op
incompatible in ``deepspeed.ops.__compatible_ops__`` before DeepSpeed creates its backend,
so nothing is compiled and ``init_distributed`` takes milliseconds. Other ways out: keep
``TORCH_EXTENSIONS_DIR`` on a persistent disk so the build happens once (a cached load takes
~0.3 s), or build the op at install time with ``DS_BUILD_SHM_COMM=1``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainwright.bench.meter import SavedTensorMeter
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.dist import collective as coll
from trainwright.dist.ports import free_port

__all__ = [
    "PG_TIMEOUT_S",
    "init_process_group",
    "WorkerFn",
    "torch_pipelining_worker",
    "deepspeed_worker",
    "deepspeed_available",
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


def torch_pipelining_worker(
    rank: int, world_size: int, master_port: int, spec: PipelineBenchSpec, out_path: str
) -> None:
    """Train the benchmark workload with ``torch.distributed.pipelining`` 1F1B on one rank.

    Stage ``rank`` holds ``spec.stage_layers(rank)`` as an ``nn.Sequential`` (stage 0 takes
    the token ids, the last stage returns logits) in a manual ``PipelineStage``, driven by
    ``Schedule1F1B`` with ``spec.micro_batches`` micro-batches and plain SGD. Each step's
    time is taken with ``time.perf_counter()`` from just after a barrier to after
    ``optimizer.step()``.

    Args:
        rank: this process's rank, which is also its stage index.
        world_size: number of ranks; must equal ``len(spec.split)``.
        master_port: TCP port of the gloo rendezvous on 127.0.0.1.
        spec: the workload.
        out_path: where to write this rank's JSON result (and ``out_path + ".pt"``).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(spec.threads_per_rank)
    _check_world(spec, world_size)
    init_process_group(rank, world_size, master_port)
    try:
        start = sum(spec.split[:rank])
        layers = spec.stage_layers(rank)
        module = nn.Sequential(*layers)
        stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
        is_last = rank == world_size - 1
        n_mb = spec.micro_batches

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # gradients of the full-batch mean loss; see the module docstring
            return _mean_loss(logits, targets) / n_mb

        kwargs: dict[str, Any] = {"n_microbatches": n_mb, "loss_fn": loss_fn}
        if _accepts(Schedule1F1B.__init__, "scale_grads"):
            kwargs["scale_grads"] = False
        schedule = Schedule1F1B(stage, **kwargs)
        step_kwargs: dict[str, Any] = {}
        if _accepts(schedule.step, "return_outputs"):
            step_kwargs["return_outputs"] = False
        optimizer = torch.optim.SGD(module.parameters(), lr=spec.lr)
        data = spec.data()

        step_times: list[float] = []
        losses: list[float] = []
        for step in range(spec.steps):
            ids, targets = data.batch(step + 1, spec.batch_size)  # steps are 1-based
            mb_losses: list[torch.Tensor] = []
            coll.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad()
            inputs = (ids,) if rank == 0 else ()
            if is_last:
                schedule.step(*inputs, target=targets, losses=mb_losses, **step_kwargs)
            else:
                schedule.step(*inputs, **step_kwargs)
            optimizer.step()
            step_times.append(time.perf_counter() - t0)
            if is_last:  # each entry is loss_mb / micro_batches: the sum is the mean
                losses.append(torch.stack(mb_losses).sum().item())
            logger.debug("torch pipelining rank %d step %d: %.3f s", rank, step, step_times[-1])

        _write_result(
            out_path,
            system="torch_pipelining_1f1b",
            rank=rank,
            step_times=step_times,
            losses=losses if is_last else None,
            layers=layers,
            start=start,
        )
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# DeepSpeed


@functools.lru_cache(maxsize=1)
def deepspeed_available() -> bool:
    """Whether ``import deepspeed`` works here (the optional extra ``bench``)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # a broken install raises all sorts of errors at import
        logger.info("deepspeed is installed but does not import: %s", err)
        return False
    return True


def _skip_deepspeed_jit_ops() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op (~40 s) on start.

    ``deepspeed.comm.torch.TorchBackend`` builds ``deepspeed_shm_comm`` when
    ``deepspeed.ops.__compatible_ops__`` says it can; the op only serves
    ``inference_all_reduce``. The dict is computed once per process and edits to it persist.
    """
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    else:
        logger.warning("cannot disable DeepSpeed's shm comm op; it may JIT-compile on start")


def _split_pipeline_module(pipeline_module: type, parts: list[int]) -> type:
    """A ``PipelineModule`` subclass whose partition is exactly ``parts`` (layer boundaries).

    DeepSpeed's ``partition_method`` offers ``uniform``, ``parameters`` and ``type:regex``,
    none of which can express an arbitrary split such as ``[4, 6]``.
    """

    class _SplitPipelineModule(pipeline_module):  # type: ignore[misc, valid-type]
        def _partition_layers(self, method: str = "uniform") -> None:
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(parts)
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    return _SplitPipelineModule


def _micro_batch_iter(
    ids: torch.Tensor, targets: torch.Tensor, micro_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches ``(ids, targets)`` in the order torch pipelining splits a batch."""
    return iter(list(zip(ids.chunk(micro_batches), targets.chunk(micro_batches), strict=True)))


def deepspeed_worker(
    rank: int,
    world_size: int,
    master_port: int,
    spec: PipelineBenchSpec,
    out_path: str,
    *,
    activation_checkpointing: bool = False,
    partition_method: str | None = None,
) -> None:
    """Train the benchmark workload with DeepSpeed's pipeline engine on one rank (CPU, gloo).

    ``PipelineModule`` over ``spec.layers()`` partitioned exactly as ``spec.split``; config
    ``train_batch_size = micro_batches * micro_batch_size``, ``gradient_accumulation_steps =
    micro_batches``, fp32, ZeRO off, a client ``torch.optim.SGD``. Each step is one
    ``engine.train_batch(iterator over the step's micro-batches)``, timed like
    :func:`torch_pipelining_worker`.

    Args:
        rank: this process's rank, which is also its stage index.
        world_size: number of ranks; must equal ``len(spec.split)``.
        master_port: TCP port of the gloo rendezvous on 127.0.0.1.
        spec: the workload.
        out_path: where to write this rank's JSON result (and ``out_path + ".pt"``).
        activation_checkpointing: recompute every transformer block in backward
            (``activation_checkpoint_interval=1`` with ``checkpointable_layers=["Block"]``;
            DeepSpeed's default would also wrap the embedding, whose integer input needs
            no grad, and crash on the first backward). The system is then
            ``"deepspeed_pipeline_ckpt"``.
        partition_method: let DeepSpeed partition (``"parameters"``, ``"uniform"``, ...)
            instead of using ``spec.split``; the system is then
            ``"deepspeed_pipeline_<method>"``.
    """
    os.environ["DS_ACCELERATOR"] = "cpu"  # before the first deepspeed import in this process
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_MASTER_ADDR,
        MASTER_PORT=str(master_port),
    )
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from trainwright.model.gpt import Block

    torch.set_num_threads(spec.threads_per_rank)
    _check_world(spec, world_size)
    _skip_deepspeed_jit_ops()
    init_process_group(rank, world_size, master_port)
    try:
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
        torch.set_num_threads(spec.threads_per_rank)  # in case DeepSpeed touched it

        all_layers = spec.layers()  # every rank builds all: identical initial weights
        parts = [sum(spec.split[:i]) for i in range(len(spec.split) + 1)]
        n_mb = spec.micro_batches
        module_cls = (PipelineModule if partition_method
                      else _split_pipeline_module(PipelineModule, parts))
        module = module_cls(
            layers=all_layers,
            num_stages=world_size,
            loss_fn=_mean_loss,  # the engine divides by gradient_accumulation_steps
            partition_method=partition_method or "uniform",  # else the subclass decides
            activation_checkpoint_interval=1 if activation_checkpointing else 0,
            checkpointable_layers=[Block.__name__] if activation_checkpointing else None,
        )
        if partition_method:
            parts = [int(x) for x in module.parts]
        start, stop = parts[rank], parts[rank + 1]
        if (module._local_start, module._local_stop) != (start, stop):
            raise RuntimeError(
                f"DeepSpeed placed layers [{module._local_start}, {module._local_stop}) on "
                f"rank {rank}, expected [{start}, {stop})"
            )
        stage_layers = all_layers[start:stop]
        del all_layers

        optimizer = torch.optim.SGD(module.parameters(), lr=spec.lr)
        config = {
            "train_batch_size": n_mb * spec.micro_batch_size,
            "train_micro_batch_size_per_gpu": spec.micro_batch_size,
            "gradient_accumulation_steps": n_mb,
            "gradient_clipping": 0.0,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": {"stage": 0},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=config, dist_init_required=False
        )
        data = spec.data()

        is_last = rank == world_size - 1
        step_times: list[float] = []
        losses: list[float] = []
        meter = SavedTensorMeter(exclude=stage_layers)
        for step in range(spec.steps):
            ids, targets = data.batch(step + 1, spec.batch_size)  # steps are 1-based
            micro = _micro_batch_iter(ids, targets, n_mb)
            coll.barrier()
            t0 = time.perf_counter()
            with meter.measure():
                loss = engine.train_batch(data_iter=micro)
            step_times.append(time.perf_counter() - t0)
            if is_last:
                losses.append(float(loss.item()))
            logger.debug("deepspeed rank %d step %d: %.3f s", rank, step, step_times[-1])

        system = _system_name(deepspeed_worker, {
            "activation_checkpointing": activation_checkpointing,
            "partition_method": partition_method})
        _write_result(
            out_path,
            system=system,
            rank=rank,
            step_times=step_times,
            losses=losses if is_last else None,
            layers=stage_layers,
            start=start,
            extra={"activation_checkpointing": activation_checkpointing,
                   "saved_peak_bytes": meter.peak_bytes,
                   "partition": [b - a for a, b in zip(parts, parts[1:], strict=False)]},
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# launching


def _system_name(worker_fn: Callable[..., Any], worker_kwargs: dict[str, Any]) -> str:
    """The system a worker runs (its function name for workers not defined here)."""
    inner = getattr(worker_fn, "func", worker_fn)
    if inner is torch_pipelining_worker:
        return "torch_pipelining_1f1b"
    if inner is deepspeed_worker:
        ckpt = worker_kwargs.get("activation_checkpointing", False)
        method = worker_kwargs.get("partition_method")
        return ("deepspeed_pipeline" + ("_ckpt" if ckpt else "")
                + (f"_{method}" if method else ""))
    return str(getattr(inner, "__name__", repr(worker_fn)))


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
