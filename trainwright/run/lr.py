"""Learning-rate schedules through ``torch.optim.lr_scheduler``, shared by per-layer optimizers.

Every layer has its own optimizer (so that it can migrate alone), and a migration creates
optimizers in the middle of a run. So the schedule does not live on them: one torch
scheduler drives a *clock* optimizer (one parameter, never updated), and before each
optimizer step :meth:`LRClock.apply` writes the clock's learning rate into every optimizer
of the stage, whichever layers it holds now. The clock's state (the scheduler's
``state_dict``) goes into the checkpoint, so a resumed run continues the same curve.

Schedules (``train.lr_schedule``), after ``train.warmup_steps`` of linear warm-up
(``LinearLR`` from ``1 / warmup`` so that step ``k`` uses ``lr * k / warmup``):
``constant`` (``ConstantLR`` with factor 1), ``cosine`` (``CosineAnnealingLR`` down to
``train.min_lr`` at the last step) and ``linear`` (``LinearLR`` down to ``min_lr``),
joined by ``SequentialLR``.
"""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler as sched

from trainwright.config import TrainConfig

__all__ = ["build_scheduler", "LRClock"]


def build_scheduler(t: TrainConfig, optimizer: torch.optim.Optimizer) -> sched.LRScheduler:
    """The torch scheduler ``t`` describes over ``optimizer`` (stepped once per train step)."""
    w = t.warmup_steps if t.warmup_steps >= 2 else 0
    decay = max(t.steps - w - 1, 1)  # scheduler steps from the first decay step to the last
    if t.lr_schedule == "cosine":
        main = sched.CosineAnnealingLR(optimizer, T_max=decay, eta_min=t.min_lr)
    elif t.lr_schedule == "linear":
        main = sched.LinearLR(optimizer, start_factor=1.0, end_factor=t.min_lr / t.lr,
                              total_iters=decay)
    else:
        main = sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if not w:  # one warm-up step would use lr * 1 / 1: nothing to warm
        return main
    warm = sched.LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1)
    return sched.SequentialLR(optimizer, [warm, main], milestones=[w])


class LRClock:
    """The run's learning rate per step, applied to any set of optimizers.

    Args:
        t: the ``[train]`` section.
        done_steps: steps already taken (a resumed run; the checkpoint's state wins when
            loaded with :meth:`load_state_dict`).
    """

    def __init__(self, t: TrainConfig, done_steps: int = 0):
        self._param = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self._param], lr=t.lr)
        self.scheduler = build_scheduler(t, self.optimizer)
        for _ in range(done_steps):
            self.advance()

    @property
    def lr(self) -> float:
        """The learning rate of the coming optimizer step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def apply(self, optimizers) -> None:
        """Give every param group of ``optimizers`` (None entries skipped) the current rate."""
        lr = self.lr
        for opt in optimizers:
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = lr

    def advance(self) -> None:
        """Move to the next step (call once after every training step)."""
        self.optimizer.step()  # no gradient: a no-op that keeps the scheduler's order check
        self.scheduler.step()

    def state_dict(self) -> dict:
        """The scheduler's state (what a checkpoint keeps)."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's :meth:`state_dict`."""
        self.scheduler.load_state_dict(state)
        self.optimizer.param_groups[0]["lr"] = self.scheduler.get_last_lr()[0]
