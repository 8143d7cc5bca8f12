"""Mixed precision: autocast of every layer's forward, and a loss scaler agreed by all ranks.

``train.precision = "bf16"`` or ``"fp16"`` runs each layer's forward (and its recompute,
which goes through the same call) under ``torch.autocast``; parameters, gradients and
optimizer state stay fp32 (the master weights). The loss is taken in fp32 from the
autocast output.

fp16 also scales the loss with ``torch.amp.GradScaler``. In a pipeline each stage holds
its own optimizers, and the gradient scale that reaches stage 0 was applied on the last
stage, so every rank must use the same scale and skip the same steps: after unscaling,
:meth:`PipelineGradScaler.agree` all-reduces one found-inf count over the whole job and
writes it into every optimizer's found-inf record before ``update`` reads it (as torch's
``ShardedGradScaler`` does per optimizer, once per rank here so that stages with different
numbers of optimizers issue the same collectives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll

__all__ = ["DTYPES", "autocast_factory", "PipelineGradScaler"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Autocast dtype of each ``train.precision`` value other than fp32."""


def autocast_factory(precision: str, device: torch.device) -> Callable | None:
    """A no-argument factory of the autocast context for ``precision`` (None for fp32)."""
    if precision not in DTYPES:
        return None
    dtype = DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class PipelineGradScaler(torch.amp.GradScaler):
    """``GradScaler`` whose inf/nan verdict is the same on every rank of the job.

    Use per step: the last stage back-propagates from ``loss * get_scale()`` (see
    :meth:`loss_gradient`); after the gradient sync, :meth:`unscale_and_agree` over the
    stage's optimizers; skip every optimizer step when it returns True; then ``update()``.
    """

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self.scale(torch.zeros((), device=device))  # creates the scale on every stage, not
        # only the last (the one whose loss is scaled)
        # a stage may hold no optimizer (parameter-free layers); ``update`` needs at least one
        # found-inf record, so a one-element anchor with a zero gradient is always unscaled
        anchor = torch.nn.Parameter(torch.zeros(1, device=device))
        anchor.grad = torch.zeros_like(anchor)
        self._anchor = torch.optim.SGD([anchor], lr=0.0)

    def loss_gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient to start backward from instead of 1: the current scale."""
        return torch.full_like(loss, self.get_scale())

    def unscale_and_agree(self, optimizers: list, group=None) -> bool:
        """Unscale every optimizer's gradients, agree on overflow over ``group`` (default: the
        whole job) and return whether the step must be skipped everywhere."""
        records = []
        for opt in [*optimizers, self._anchor]:
            self.unscale_(opt)
            records += list(self._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        found = torch.zeros(1, dtype=torch.float32)
        for r in records:
            found += r.float().cpu()
        if dist.is_initialized():
            coll.all_reduce(found, group=group)
        verdict = float(found.item()) > 0
        for r in records:  # update() reads these: every rank backs off (or grows) alike
            r.fill_(1.0 if verdict else 0.0)
        return verdict

    def state(self) -> dict:
        """The scaler's state for a checkpoint (empty when disabled)."""
        return self.state_dict() if self.is_enabled() else {}
