"""What the optimizer step does around the update: fp16 loss scaling, clipping by the
global norm, and the learning-rate schedule.

:class:`UpdateRules` holds them for ``Trainer.update_weights``, which reads, in order:
unscale and agree on overflow (:meth:`UpdateRules.unscale_and_agree`), clip
(:meth:`UpdateRules.clip`), set the learning rate, step the exchange's
:class:`~trainwright.sync.base.WeightUpdate`, then :meth:`UpdateRules.advance` (loss scale
and learning-rate clock). Its state (schedule position, loss scale) is checkpointed under
the name ``update``.

[Note: clipping] Clipping is by the global norm over every stage and replica
(``train.clip_norm``). After the data-parallel sync each replica of a stage holds the
same averaged gradient (dense and sparse sync), so the norm's sum of squares is taken
once per stage and all-reduced over the pipeline group only; summing over the replicas
too would count every gradient ``dp`` times. With ``sync.strategy = "hierarchical"`` a
rank holds the averaged gradient of its own slice only: slices are summed inside the
node (each slice once), then over the pipeline. Sparse (row) gradients count their
coalesced values. The coefficient is ``clip_grad_norm_``'s: ``min(max_norm / (norm +
1e-6), 1)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainwright.config import Config
from trainwright.dist import collective as coll
from trainwright.run.lr import LRClock
from trainwright.run.precision import PipelineGradScaler
from trainwright.sync.base import GradShard

__all__ = ["UpdateRules", "local_square_sum", "global_grad_norm", "scale_gradients"]

log = logging.getLogger(__name__)


def _square_sum(g: torch.Tensor) -> torch.Tensor:
    if g.is_sparse:
        g = g.coalesce().values()
    return g.detach().double().pow(2).sum()


def local_square_sum(params: list, shard: GradShard | None = None) -> torch.Tensor:
    """This rank's share of the squared global norm (float64 scalar on the CPU).

    ``shard``: where the synced gradients live when this rank holds only a slice of them
    (:meth:`GradSync.grad_shard`); the slices are summed over its group (each once).
    """
    if shard is not None:
        total = _square_sum(shard.owned).cpu().reshape(1)
        if shard.group is not None:
            coll.all_reduce(total, group=shard.group)
        return total
    parts = [_square_sum(p.grad).cpu() for p in params if p.grad is not None]
    return torch.stack(parts).sum().reshape(1) if parts else torch.zeros(1, dtype=torch.float64)


def global_grad_norm(params: list, pp_group=None, shard: GradShard | None = None) -> float:
    """The L2 norm of every gradient of the model (all stages), the same on every rank."""
    total = local_square_sum(params, shard)
    if dist.is_initialized():
        coll.all_reduce(total, group=pp_group)
    return float(total.sqrt())


def scale_gradients(params: list, max_norm: float, norm: float,
                    shard: GradShard | None = None) -> float:
    """Multiply every gradient (or the owned ``shard``) by ``min(max_norm / (norm + 1e-6),
    1)``; return the factor."""
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef >= 1.0:
        return 1.0
    with torch.no_grad():
        if shard is not None:
            shard.owned.mul_(coef)
            return coef
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return coef


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
