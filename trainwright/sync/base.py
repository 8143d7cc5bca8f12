"""The interfaces of a gradient exchange: :class:`GradSync` syncs, :class:`WeightUpdate`
turns the synced gradients into new weights.

The two are separate jobs. The trainer's step (``Trainer.train_step``) calls
:meth:`GradSync.sync` at the schedule's ``SYNC`` action and, at its ``STEP`` action,
unscales and clips the gradients, steps the exchange's :class:`WeightUpdate` and advances
the learning rate. What clipping needs to know about where the synced gradients live is
declared here (:meth:`GradSync.grad_shard`), not probed.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["GradSync", "GradShard", "WeightUpdate", "LayerOptimizers"]


@dataclass(frozen=True)
class GradShard:
    """The slice of a flat gradient buffer whose averaged values this rank owns.

    A strategy that shards gradients (hierarchical) holds the synced gradient of the owned
    slice ``flat[lo:hi]`` only; the slices of ``group`` (None: no other rank shares the
    buffer) together make the whole.
    """

    flat: torch.Tensor
    lo: int
    hi: int
    group: object = None

    @property
    def owned(self) -> torch.Tensor:
        """The owned slice of the buffer (a view)."""
        return self.flat[self.lo:self.hi]


class WeightUpdate(ABC):
    """How synced gradients become weights, once per ``STEP``.

    The learning rate and loss scaling act on :meth:`optimizers`; :meth:`step` applies the
    update and clears the gradients; :meth:`skip` clears them without an update (an fp16
    overflow).
    """

    @abstractmethod
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer that steps this rank's parameters now."""

    @abstractmethod
    def step(self) -> None:
        """Apply the update for the stage's layers and clear their gradients."""

    @abstractmethod
    def skip(self) -> None:
        """Clear the gradients without updating (every rank skips the same step)."""


class LayerOptimizers(WeightUpdate):
    """Each layer's own optimizer (layers carry theirs so that they can migrate).

    Args:
        stage: anything with ``slots`` (``LayerSlot`` list, read at every call: layers may
            have moved) and ``parameters()``.
    """

    def __init__(self, stage):
        self.stage = stage

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the stage's current layers."""
        return [s.optimizer for s in self.stage.slots if s.optimizer is not None]

    def step(self) -> None:
        """Every layer's optimizer steps, then clears its gradients."""
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad(set_to_none=True)

    def skip(self) -> None:
        """Drop every gradient of the stage."""
        for p in self.stage.parameters():
            p.grad = None


class GradSync(ABC):
    """A gradient exchange across data-parallel replicas, plugged into the trainer's step.

    The trainer calls :meth:`sync` at the schedule's ``SYNC`` action (after the last
    backward of a step), :meth:`attach` whenever the stage's layers change (at start, at the
    ``SYNC`` of a migration step, after model edits), :meth:`layers_changing` just before
    they change, :meth:`full_state` around a checkpoint, :meth:`begin_step` before a step's
    compute and :meth:`applied_through` after it, and steps :meth:`weight_update` at
    ``STEP``. The defaults suit synchronous data parallel; the token ring overrides them.
    """

    @abstractmethod
    def sync(self, params: list) -> None:
        """Average the gradients of ``params`` over the data-parallel replicas, in place."""

    def weight_update(self, stage) -> WeightUpdate:
        """How this exchange's synced gradients become weights: each layer's own optimizer
        by default; a strategy that shards optimizer state, or decides itself what goes into
        ``p.grad``, returns its own."""
        return LayerOptimizers(stage)

    def grad_shard(self) -> GradShard | None:
        """Where this rank's synced gradients live when it holds only a shard of them
        (waiting for the sync to finish first); None: every parameter's ``.grad`` holds its
        whole averaged gradient."""
        return None

    def attach(self, modules: list) -> None:  # noqa: B027 - an optional hook
        """Learn the stage's layers (called at start and after every change of layers)."""

    def layers_changing(self, slots: list) -> None:  # noqa: B027 - an optional hook
        """The stage's layers (``LayerSlot`` list) are about to change (a migration or a
        model edit): state the exchange holds for them must go back to their own
        optimizers, which travel with the layers."""

    @contextlib.contextmanager
    def full_state(self, slots: list) -> Iterator[None]:
        """Inside: each layer's own optimizer holds its layer's full state (a checkpoint
        reads it there). Strategies that shard optimizer state gather it for the block."""
        yield

    def begin_step(self, step: int) -> bool:
        """Before step ``step``'s compute; False: skip its forward and backward (the token
        ring closed the step without this node) and go straight to the update."""
        return True

    def applied_through(self, step: int) -> int:
        """The last step whose update is applied once step ``step``'s ``STEP`` ran (the ring
        may apply several closed steps at once)."""
        return step
