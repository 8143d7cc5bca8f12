"""The one way trainwright hands tensors to a ``torch.distributed`` collective or transfer.

Each backend reads tensors from one kind of memory: NCCL from the current CUDA device, gloo
from host memory (gloo's point-to-point and most of its collectives take CPU tensors
only). A tensor on the other device fails (NCCL given a CPU tensor) or is silently slow.
:func:`backend_device` says which device a process group's backend needs, and the
functions below, named and called like their ``torch.distributed`` namesakes, move every
tensor there first (no copy when it is there already, the normal case) and copy results
back into the caller's tensors. Every collective and point-to-point call in the package
goes through this module; ``tests/test_collective.py`` checks that no other module calls
``torch.distributed``'s collectives directly and that, on real multi-process runs, every
call reaches torch with its tensors on the device :func:`backend_device` names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["gather_to_first", "all_gather_objects", "COLLECTIVES", "backend_device", "all_reduce", "all_gather", "all_gather_into_tensor",
           "reduce", "broadcast", "send", "recv", "isend", "irecv", "barrier",
           "all_gather_object", "broadcast_object_list", "gather_object"]

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "send",
               "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
               "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list")
"""``torch.distributed`` functions that only this module may call."""


def backend_device(group=None) -> torch.device | None:
    """The device a collective on ``group`` (None: the default group) needs its tensors
    on: the current CUDA device for NCCL, the CPU for gloo; None for a group that takes
    both (a ``"cpu:gloo,cuda:nccl"`` backend)."""
    backend = str(dist.get_backend(group)).lower()
    if "," in backend:
        return None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _placed(tensors: Sequence[torch.Tensor], device: torch.device | None) -> list[torch.Tensor]:
    """``tensors`` on ``device`` (the same objects where they already are)."""
    if device is None:
        return list(tensors)
    return [t if t.device == device else t.to(device) for t in tensors]


class _CopyBack:
    """A work handle whose ``wait`` also copies moved results back into the caller's
    tensors; it keeps the moved tensors alive until then."""

    def __init__(self, work, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.work, self.pairs = work, pairs

    def wait(self, *args, **kwargs) -> bool:
        """Wait for the transfer, then copy results back (once)."""
        done = self.work.wait(*args, **kwargs) if self.work is not None else True
        for orig, moved in self.pairs:
            orig.copy_(moved)
        self.pairs = []
        return done

    def is_completed(self) -> bool:
        """Whether the underlying transfer has completed."""
        return self.work is None or self.work.is_completed()


def _finish(work, originals: Sequence[torch.Tensor], moved: Sequence[torch.Tensor],
            async_op: bool, copy_back: bool = True):
    """Return what torch returns, copying moved outputs back now (blocking call) or on
    ``wait`` (asynchronous call)."""
    pairs = [(o, m) for o, m in zip(originals, moved, strict=True) if o is not m]
    if not pairs:
        return work
    if not copy_back:  # inputs only: keep the moved copies alive until the work completes
        return _Keep(work, pairs)
    if async_op:
        return _CopyBack(work, pairs)
    for orig, new in pairs:
        orig.copy_(new)
    return work


class _Keep(_CopyBack):
    """A work handle that keeps moved inputs alive until it is waited on."""

    def wait(self, *args, **kwargs) -> bool:
        """Wait for the transfer, then drop the moved inputs."""
        done = self.work.wait(*args, **kwargs)
        self.pairs = []
        return done


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``torch.distributed.all_reduce`` with ``tensor`` on the group's backend device."""
    (t,) = _placed([tensor], backend_device(group))
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    return _finish(work, [tensor], [t], async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    """``torch.distributed.all_gather`` with every tensor on the group's backend device."""
    dev = backend_device(group)
    outs, (t,) = _placed(tensor_list, dev), _placed([tensor], dev)
    work = dist.all_gather(outs, t, group=group, async_op=async_op)
    return _finish(work, tensor_list, outs, async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor`` on the group's backend device."""
    dev = backend_device(group)
    (out,), (t,) = _placed([output], dev), _placed([tensor], dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, t, group=group, async_op=async_op)
    return _finish(work, [output], [out], async_op)


def reduce(tensor: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group=None,
           async_op: bool = False):
    """``torch.distributed.reduce`` (``dst``: global rank) on the group's backend device."""
    (t,) = _placed([tensor], backend_device(group))
    work = dist.reduce(t, dst=dst, op=op, group=group, async_op=async_op)
    return _finish(work, [tensor], [t], async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """``torch.distributed.broadcast`` (``src``: global rank) on the backend device."""
    (t,) = _placed([tensor], backend_device(group))
    work = dist.broadcast(t, src=src, group=group, async_op=async_op)
    return _finish(work, [tensor], [t], async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """``torch.distributed.send`` (``dst``: global rank) from the backend device."""
    (t,) = _placed([tensor], backend_device(group))
    dist.send(t, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    """``torch.distributed.recv`` (``src``: global rank) into the backend device."""
    (t,) = _placed([tensor], backend_device(group))
    out = dist.recv(t, src, group=group, tag=tag)
    _finish(None, [tensor], [t], async_op=False)
    return out


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """``torch.distributed.isend`` from the backend device; the work keeps a moved copy
    alive until it is waited on."""
    (t,) = _placed([tensor], backend_device(group))
    work = dist.isend(t, dst=dst, group=group, tag=tag)
    return _finish(work, [tensor], [t], async_op=True, copy_back=False)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    """``torch.distributed.irecv`` into the backend device; ``wait`` copies a moved
    buffer back into ``tensor``."""
    (t,) = _placed([tensor], backend_device(group))
    work = dist.irecv(t, src=src, group=group, tag=tag)
    return _finish(work, [tensor], [t], async_op=True)


def barrier(group=None) -> None:
    """``torch.distributed.barrier`` (no tensors)."""
    dist.barrier(group)


def all_gather_object(object_list: list, obj, group=None) -> None:
    """``torch.distributed.all_gather_object`` (torch places the pickled bytes itself)."""
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    """``torch.distributed.broadcast_object_list`` (torch places the bytes itself)."""
    dist.broadcast_object_list(object_list, src=src, group=group)


def gather_object(obj, object_gather_list: list | None = None, dst: int = 0,
                  group=None) -> None:
    """``torch.distributed.gather_object`` (torch places the bytes itself)."""
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)


def gather_to_first(obj, world: int, rank: int) -> list | None:
    """``obj`` of every rank of the default group on rank 0 (None elsewhere); without a
    process group, ``[obj]``."""
    if not dist.is_initialized():
        return [obj]
    out: list | None = [None] * world if rank == 0 else None
    gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj, size: int, group=None) -> list:
    """``obj`` of every member of ``group`` (of ``size`` members), in rank order; without a
    process group, ``[obj]``."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * size
    all_gather_object(out, obj, group=group)
    return out
