"""What the optimizer step does around the update: fp16 loss scaling, clipping by the
global norm, and the learning-rate schedule.

:class:`UpdateRules` holds them for ``Trainer.update_weights``, which reads, in order:
unscale and agree on overflow (:meth:`UpdateRules.unscale_and_agree`), clip
(:meth:`UpdateRules.clip`), set the learning rate, step the exchange's
:class:`~trainwright.sync.base.WeightUpdate`, then :meth:`UpdateRules.advance` (loss scale
and learning-rate clock). Its state (schedule position, loss scale) is checkpointed under
the name ``update``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from trainwright.config import Config
from trainwright.run.clip import global_grad_norm, scale_gradients
from trainwright.run.lr import LRClock
from trainwright.run.precision import PipelineGradScaler
from trainwright.sync.base import GradShard

__all__ = ["UpdateRules"]

log = logging.getLogger(__name__)


class UpdateRules:
    """Precision, clipping and the learning-rate schedule of a rank's optimizer step.

    Args:
        cfg: the configuration (``train.precision``, ``clip_norm``, ``lr_schedule``...).
        pp_group: this rank's pipeline group (the clip norm's sum over stages).
        done_steps: steps already taken (resume).
        device: where the loss scale lives.
        norm_skip: this rank's parameters the global norm must not count (e.g. the second
            copy of a tied weight, whose gradient another stage already counts).
    """

    def __init__(self, cfg: Config, pp_group=None, done_steps: int = 0,
                 device: torch.device | None = None,
                 norm_skip: Callable[[], list] = list):
        t = cfg.train
        self.pp_group, self.clip_norm, self.norm_skip = pp_group, t.clip_norm, norm_skip
        self.schedule = [t.lr_schedule, t.lr, t.min_lr, t.warmup_steps, t.steps]
        """The settings the schedule was built from (a resume with others rebuilds it)."""
        self.lr = LRClock(t, done_steps)
        self.scaler = None
        if t.precision == "fp16":
            self.scaler = PipelineGradScaler((device or torch.device("cpu")).type)

    @property
    def loss_gradient(self) -> Callable | None:
        """What the last stage's backward starts from (the loss scale), or None."""
        return self.scaler.loss_gradient if self.scaler is not None else None

    @property
    def local(self) -> bool:
        """Whether this rank's step needs nothing from the other pipeline ranks (no global
        clip norm, no fp16 overflow vote), so it may run after theirs
        (``train.carry_weight_grads``)."""
        return self.clip_norm == 0 and self.scaler is None

    def unscale_and_agree(self, optimizers: list, record: dict) -> bool:
        """fp16: unscale the gradients and agree with every rank whether any overflowed.
        Returns whether every rank skips this step (always False without fp16)."""
        if self.scaler is None:
            return False
        record["loss_scale"] = self.scaler.get_scale()
        skip = self.scaler.unscale_and_agree(optimizers)
        record["skipped"] = skip
        return skip

    def clip(self, params: list, shard: Callable[[], GradShard | None], record: dict) -> None:
        """With ``train.clip_norm``: scale the synced gradients to at most that global norm
        (``shard``: where they live when this rank holds a slice only)."""
        if self.clip_norm <= 0:
            return
        skip_ids = {id(p) for p in self.norm_skip()}
        where = shard()
        norm = global_grad_norm([p for p in params if id(p) not in skip_ids],
                                self.pp_group, where)
        record["grad_norm"] = norm
        record["clip_coef"] = scale_gradients(params, self.clip_norm, norm, where)

    def advance(self) -> None:
        """After the update: the loss scale grows or backs off, the learning rate moves on."""
        if self.scaler is not None:
            self.scaler.update()
        self.lr.advance()

    def state_dict(self) -> dict:
        """Schedule and loss-scaler state for the checkpoint."""
        return {"schedule": list(self.schedule), "lr_scheduler": self.lr.state_dict(),
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`. A schedule saved under other settings (e.g. a
        resume that raised ``train.steps``) is not loaded: the clock built from the current
        settings and fast-forwarded to the resumed step stands."""
        if state.get("schedule") == self.schedule:
            self.lr.load_state_dict(state["lr_scheduler"])
        else:
            log.info("the learning-rate schedule settings changed since the checkpoint (%s -> "
                     "%s); following the new ones", state.get("schedule"), self.schedule)
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
