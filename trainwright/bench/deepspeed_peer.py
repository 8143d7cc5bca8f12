"""DeepSpeed's pipeline engine training the shared benchmark workload (a bench peer).

:func:`deepspeed_worker` trains :class:`~trainwright.bench.spec.PipelineBenchSpec`'s workload
with DeepSpeed's ``PipelineModule`` / ``PipelineEngine`` (system ``"deepspeed_pipeline"``, or
``"deepspeed_pipeline_ckpt"`` with activation checkpointing of the transformer blocks) and
writes the result format of :mod:`trainwright.bench.peers`; launch it with
:func:`~trainwright.bench.peers.spawn_peer`. :func:`deepspeed_train` is its body for a
process group that already exists (``bench pipeline`` runs it in its own group, and
:func:`deepspeed_comm` hands that group to DeepSpeed). DeepSpeed is the optional extra
``bench``; this module imports without it and :func:`deepspeed_available` tells whether it
is there.

Loss scaling: ``engine.backward`` divides the loss by ``gradient_accumulation_steps`` itself
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

import contextlib
import functools
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from trainwright.bench.meter import SavedTensorMeter
from trainwright.bench.peers import (
    _MASTER_ADDR,
    PG_TIMEOUT_S,
    _check_world,
    _mean_loss,
    _write_result,
    init_process_group,
)
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.dist import collective as coll

__all__ = ["deepspeed_available", "deepspeed_worker", "deepspeed_train", "deepspeed_comm",
           "deepspeed_env", "deepspeed_system_name"]

logger = logging.getLogger(__name__)


def deepspeed_system_name(activation_checkpointing: bool = False,
                          partition_method: str | None = None, **_: object) -> str:
    """The system name of a :func:`deepspeed_worker` run with these options."""
    return ("deepspeed_pipeline" + ("_ckpt" if activation_checkpointing else "")
            + (f"_{partition_method}" if partition_method else ""))



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
    meter: bool = False,
) -> None:
    """Train the benchmark workload with DeepSpeed's pipeline engine on one rank (CPU, gloo).

    ``PipelineModule`` over ``spec.layers()`` partitioned exactly as ``spec.split``; config
    ``train_batch_size = micro_batches * micro_batch_size``, ``gradient_accumulation_steps =
    micro_batches``, fp32, ZeRO off, a client ``torch.optim.SGD``. Each step is one
    ``engine.train_batch(iterator over the step's micro-batches)``, timed like
    :func:`~trainwright.bench.peers.torch_pipelining_worker`.

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
        meter: wrap every step in a :class:`SavedTensorMeter` (``saved_peak_bytes``);
            off by default: its saved-tensor hooks slow the step, and a timed comparison
            runs every system unmetered.
    """
    torch.set_num_threads(spec.threads_per_rank)
    _check_world(spec, world_size)
    deepspeed_env(rank, world_size, master_port)
    init_process_group(rank, world_size, master_port)
    try:
        result, stage_layers, start = deepspeed_train(
            rank, world_size, spec, activation_checkpointing=activation_checkpointing,
            partition_method=partition_method, meter=meter)
        _write_result(out_path, layers=stage_layers, start=start, **result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


deepspeed_worker.system_name = deepspeed_system_name  # how spawn_peer names its runs


def deepspeed_env(rank: int, world_size: int, master_port: int | None = None) -> None:
    """Environment DeepSpeed reads on CPU: ``DS_ACCELERATOR=cpu`` (before the first
    ``import deepspeed`` in the process) and the launcher's rank variables."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_MASTER_ADDR)
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)


def deepspeed_comm() -> None:
    """Hand DeepSpeed's communication layer the process group that is already initialised
    (gloo), without JIT-compiling its shm op; idempotent."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    _skip_deepspeed_jit_ops()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))


def deepspeed_train(rank: int, world_size: int, spec: PipelineBenchSpec, *,
                    activation_checkpointing: bool = False,
                    partition_method: str | None = None,
                    meter: bool = False) -> tuple[dict, list[nn.Module], int]:
    """The body of :func:`deepspeed_worker` in an initialised gloo process group.

    ``meter``: wrap every step in a :class:`SavedTensorMeter` (``saved_peak_bytes``); it
    slows the step, so timed comparisons leave it off.

    Returns:
        This rank's result (keyword arguments of the JSON result), its stage's layers and
        the global index of the first of them.
    """
    os.environ["DS_ACCELERATOR"] = "cpu"  # before the first deepspeed import in this process
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from trainwright.model.gpt import Block

    _check_world(spec, world_size)
    deepspeed_comm()
    torch.set_num_threads(spec.threads_per_rank)  # in case DeepSpeed touched it
    all_layers = spec.layers()  # every rank builds all: identical initial weights
    parts = [sum(spec.split[:i]) for i in range(len(spec.split) + 1)]
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
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=spec.lr),
        config=_deepspeed_config(spec), dist_init_required=False)
    step_times, losses, peak = _deepspeed_steps(engine, spec, rank == world_size - 1,
                                                stage_layers if meter else None)
    system = deepspeed_system_name(activation_checkpointing, partition_method)
    extra = {"activation_checkpointing": activation_checkpointing,
             "partition": [b - a for a, b in zip(parts, parts[1:], strict=False)]}
    if meter:
        extra["saved_peak_bytes"] = peak
    result = {"system": system, "rank": rank, "step_times": step_times,
              "losses": losses if rank == world_size - 1 else None, "extra": extra}
    return result, stage_layers, start


def _deepspeed_config(spec: PipelineBenchSpec) -> dict:
    """fp32, ZeRO off, ``micro_batches`` accumulation steps of ``micro_batch_size``."""
    return {
        "train_batch_size": spec.micro_batches * spec.micro_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.micro_batches,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _deepspeed_steps(engine, spec: PipelineBenchSpec, is_last: bool,
                     metered: list[nn.Module] | None) -> tuple[list, list, int | None]:
    """``spec.steps`` ``train_batch`` calls, each timed from just after a barrier."""
    data = spec.data()
    step_times: list[float] = []
    losses: list[float] = []
    meter = SavedTensorMeter(exclude=metered) if metered is not None else None
    for step in range(spec.steps):
        ids, targets = data.batch(step + 1, spec.batch_size)  # steps are 1-based
        micro = _micro_batch_iter(ids, targets, spec.micro_batches)
        coll.barrier()
        t0 = time.perf_counter()
        with meter.measure() if meter else contextlib.nullcontext():
            loss = engine.train_batch(data_iter=micro)
        step_times.append(time.perf_counter() - t0)
        if is_last:
            losses.append(float(loss.item()))
    return step_times, losses, meter.peak_bytes if meter else None
