"""Dense gradient all-reduce: the baseline every other sync strategy is compared with.

:class:`BucketedAllReduce` flattens gradients into buckets of about ``bucket_bytes`` (in
reverse parameter order, as DDP does, since the last layers finish backward first) and
all-reduces them asynchronously; :func:`naive_all_reduce` does one all-reduce per
parameter and is kept as the readable oracle.
"""

from __future__ import annotations

import torch

from trainwright.dist import collective as coll
from trainwright.sync.base import GradSync

__all__ = ["BucketedAllReduce", "naive_all_reduce"]


def naive_all_reduce(params: list[torch.nn.Parameter], group, world: int) -> None:
    """Average each parameter's gradient over ``group``, one all-reduce per parameter."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        coll.all_reduce(p.grad, group=group)
        p.grad.div_(world)


class BucketedAllReduce(GradSync):
    """Average gradients over a process group in flat buckets.

    Args:
        group: the data-parallel group.
        world: its size; with 1 the sync does nothing.
        bucket_bytes: target bucket size.
    """

    def __init__(self, group, world: int, bucket_bytes: int = 25 * 2**20):
        self.group, self.world, self.bucket_bytes = group, world, bucket_bytes

    def buckets(self, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        """Group parameters (reverse order, same dtype and device) into buckets."""
        out: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            same = out and out[-1][0].dtype == p.dtype and out[-1][0].device == p.device
            if not out or not same or size + nbytes > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += nbytes
        return out

    def sync(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce and average the gradients of ``params`` in place."""
        if self.world == 1 or not params:
            return
        pending = []
        for bucket in self.buckets(params):
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if len(bucket) == 1 and bucket[0].grad.is_contiguous():
                # a bucket of one (a parameter at least bucket-sized): in place, no copies
                flat = bucket[0].grad.view(-1)
            else:
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            pending.append((coll.all_reduce(flat, group=self.group, async_op=True), flat, bucket))
        for work, flat, bucket in pending:
            work.wait()
            flat.div_(self.world)
            if flat.data_ptr() == bucket[0].grad.data_ptr():
                continue
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
