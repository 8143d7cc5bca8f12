"""The optimizer step of a pipeline rank: loss-scale check, clipping, learning rate, update.

:class:`UpdateStep` is the :class:`~trainwright.sync.base.GradSync` the pipeline runtime
calls at its ``SYNC`` and ``STEP`` actions. It wraps the configured gradient exchange:
``sync`` is the exchange's; ``step`` first (fp16) unscales the gradients and agrees with
every rank whether any overflowed, then (``train.clip_norm``) clips by the global norm,
then gives every optimizer the step's learning rate and lets the exchange step them, or
clears the gradients of a skipped step. What it did is in :attr:`UpdateStep.last`
(``lr``, ``grad_norm``, ``loss_scale``, ``skipped``), logged with the step's metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from trainwright.config import Config
from trainwright.run.clip import global_grad_norm, scale_gradients
from trainwright.run.lr import LRClock
from trainwright.run.precision import PipelineGradScaler
from trainwright.sync.base import GradSync

__all__ = ["UpdateStep", "make_update_step"]

log = logging.getLogger(__name__)


class UpdateStep(GradSync):
    """Precision, clipping and the learning-rate schedule around a gradient exchange.

    Args:
        cfg: the configuration (``train.precision``, ``clip_norm``, ``lr_schedule``...).
        inner: the gradient exchange (dense, sparse or hierarchical).
        stage: the rank's stage (its current layers and optimizers).
        pp_group: this rank's pipeline group (the clip norm's sum over stages).
        done_steps: steps already taken (resume).
    """

    def __init__(self, cfg: Config, inner: GradSync, stage, pp_group=None,
                 done_steps: int = 0, device: torch.device | None = None):
        t = cfg.train
        self.inner, self.stage, self.pp_group = inner, stage, pp_group
        self.clip_norm = t.clip_norm
        self.schedule = [t.lr_schedule, t.lr, t.min_lr, t.warmup_steps, t.steps]
        """The settings the schedule was built from (a resume with others rebuilds it)."""
        self.clock = LRClock(t, done_steps)
        self.scaler = None
        if t.precision == "fp16":
            self.scaler = PipelineGradScaler((device or torch.device("cpu")).type)
            stage.loss_gradient = self.scaler.loss_gradient
        self.last: dict = {}
        self.norm_skip: Callable[[], list] = list
        """This rank's parameters the global norm must not count (e.g. the second copy of a
        tied weight, whose gradient another stage already counts)."""

    @property
    def local(self) -> bool:
        """Whether this rank's step needs nothing from the other pipeline ranks (no global
        clip norm, no fp16 overflow vote), so it may run after theirs
        (``train.carry_weight_grads``)."""
        return self.clip_norm == 0 and self.scaler is None

    def sync(self, params: list) -> None:
        """The wrapped exchange's sync."""
        self.inner.sync(params)

    def optimizers(self, slots: list) -> list:
        """Every optimizer that steps this rank's parameters now."""
        sharded = getattr(self.inner, "optimizer", None)
        if sharded is not None:
            return [sharded]
        return [s.optimizer for s in slots if s.optimizer is not None]

    def step(self, slots: list) -> None:
        """Check overflow, clip, set the learning rate, update (or skip) and clear grads."""
        opts, params = self.optimizers(slots), self.stage.parameters()
        row = {"lr": self.clock.lr}
        skip = False
        if self.scaler is not None:
            row["loss_scale"] = self.scaler.get_scale()
            skip = self.scaler.unscale_and_agree(opts)
            row["skipped"] = skip
        if self.clip_norm > 0 and not skip:
            skip_ids = {id(p) for p in self.norm_skip()}
            norm = global_grad_norm([p for p in params if id(p) not in skip_ids],
                                    self.pp_group, self.inner)
            row["grad_norm"] = norm
            row["clip_coef"] = scale_gradients(params, self.clip_norm, norm, self.inner)
        if skip:
            for p in params:
                p.grad = None
        else:
            self.clock.apply(opts)
            self.inner.step(slots)
        if self.scaler is not None:
            self.scaler.update()
        self.clock.advance()
        self.last = row

    def attach(self, modules: list) -> None:
        """The wrapped exchange's attach."""
        self.inner.attach(modules)

    def state_dict(self) -> dict:
        """Schedule and loss-scaler state for the checkpoint."""
        return {"schedule": list(self.schedule), "lr_scheduler": self.clock.state_dict(),
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`. A schedule saved under other settings (e.g. a
        resume that raised ``train.steps``) is not loaded: the clock built from the current
        settings and fast-forwarded to the resumed step stands."""
        if state.get("schedule") == self.schedule:
            self.clock.load_state_dict(state["lr_scheduler"])
        else:
            log.info("the learning-rate schedule settings changed since the checkpoint (%s -> "
                     "%s); following the new ones", state.get("schedule"), self.schedule)
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])


def make_update_step(cfg: Config, inner: GradSync, stage, topo, start: int,
                     device: torch.device) -> GradSync:
    """The :class:`UpdateStep` around ``inner`` (the token ring keeps its own step), its
    schedule at step ``start``; a resumed trainer then loads the checkpoint's
    :meth:`UpdateStep.state_dict` (``Trainer.register_state``)."""
    if cfg.sync.strategy == "tokenring":
        return inner
    return UpdateStep(cfg, inner, stage, topo.pp_group, start - 1, device)
