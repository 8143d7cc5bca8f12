"""``SparseDataParallel``: data parallel like ``DistributedDataParallel``, with row-sparse
embedding gradients averaged by :class:`~trainwright.sync.sparse.SparseGradSync`."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from trainwright.dist import collective as coll
from trainwright.sync.sparse import SparseGradSync
from trainwright.sync.sparse_cost import LinkModel, PathChoice
from trainwright.sync.sparse_exchange import global_rank

__all__ = ["SparseDataParallel"]


class SparseDataParallel(nn.Module):
    """Data parallel like ``DistributedDataParallel``, with row-sparse embedding gradients.

    Wrap the model on every rank; the parameters are broadcast from the group's first rank.
    After each ``backward`` the gradients are averaged over the group: embedding tables
    (and any parameter with a sparse gradient) through :class:`SparseGradSync`, the rest
    through the dense bucketed all-reduce. Use :meth:`no_sync` to accumulate gradients
    locally, or ``auto_sync=False`` and call :meth:`sync_gradients` yourself.

    Args:
        module: the model.
        process_group: the data-parallel group (None: the default group).
        path: ``"auto"`` or a forced path (see :data:`~trainwright.sync.sparse.PATHS`).
        link: a cost model (None: calibrated at the first sync).
        bucket_mb: dense bucket size in MiB.
        auto_sync: synchronise at the end of every backward.
        explore: see :class:`SparseGradSync` (0: always the cheapest estimate).
    """

    def __init__(self, module: nn.Module, process_group=None, *, path: str = "auto",
                 link: LinkModel | None = None, bucket_mb: float = 25.0, auto_sync: bool = True,
                 explore: float = 2.0):
        super().__init__()
        self.module = module
        self.process_group = process_group
        world = dist.get_world_size(process_group)
        self.grad_sync = SparseGradSync(process_group, world, int(bucket_mb * 2**20), path=path,
                                        link=link, explore=explore)
        self.grad_sync.watch([module])
        src = global_rank(process_group, 0)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                coll.broadcast(t.data, src=src, group=process_group)
        self._auto, self._enabled, self._queued = auto_sync, True, False
        self._params = [p for p in module.parameters() if p.requires_grad]
        if auto_sync:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def _grad_ready(self, _p: torch.Tensor) -> None:
        if self._enabled and not self._queued:
            self._queued = True  # sync once, after the whole backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.sync_gradients()

    def sync_gradients(self) -> list[PathChoice]:
        """Average the gradients now; returns the path taken for each row-sparse parameter."""
        return self.grad_sync.sync(self._params)

    @property
    def last_paths(self) -> list[PathChoice]:
        """The choices of the last synchronisation."""
        return self.grad_sync.last

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the automatic synchronisation inside this block (gradient accumulation)."""
        before, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = before
