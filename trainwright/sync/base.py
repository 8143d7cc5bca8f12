"""The interface every gradient exchange implements: data-parallel sync and the token ring."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

__all__ = ["GradSync"]


class GradSync(ABC):
    """A gradient exchange, plugged into the trainer's one step loop.

    The pipeline runtime calls :meth:`sync` at the schedule's ``SYNC`` action (after the
    last backward of a step) and :meth:`step` at its ``STEP`` action. The trainer calls
    :meth:`attach` whenever the stage's layers change (at start, at the ``SYNC`` of a
    migration step, after model edits), :meth:`layers_changing` just before they change,
    :meth:`full_state` around a checkpoint, :meth:`begin_step` before a step's compute and
    :meth:`applied_through` after it. The defaults suit synchronous data
    parallel; the token ring overrides all of them.

    The default ``step`` runs each layer's own optimizer (layers carry their optimizer so
    that they can migrate between stages); strategies that shard optimizer state override it.
    """

    @abstractmethod
    def sync(self, params: list) -> None:
        """Average the gradients of ``params`` over the data-parallel replicas, in place."""

    def step(self, slots: list) -> None:
        """Apply the update for the stage's layers (``LayerSlot`` list) and clear gradients."""
        for slot in slots:
            if slot.optimizer is not None:
                slot.optimizer.step()
                slot.optimizer.zero_grad(set_to_none=True)

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
        ring closed the step without this node) and go straight to :meth:`step`."""
        return True

    def applied_through(self, step: int) -> int:
        """The last step whose update is applied once step ``step``'s ``STEP`` ran (the ring
        may apply several closed steps at once)."""
        return step
