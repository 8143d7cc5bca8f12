"""Deciding that a pipeline is unbalanced, without reacting to timing noise.

The last stage sees every stage's per-layer times once per step (see
``Trainer.pipeline_costs``) and asks :class:`ImbalanceDetector` whether to
re-partition. Three things keep noise from causing thrashing:

- **smoothing**: stage times are an exponential moving average over checks;
- **hysteresis**: imbalance is declared only when the last ``patience`` observations were
  each out of balance (the adaptive pipeline's pairwise test,
  :func:`~trainwright.plan.partition.within_threshold`) *and* the smoothed times are too:
  one slow step (a pause, a noisy neighbour) moves the average but not the strike count;
- **quiet periods**: no decision while a migration is under way, and none for
  ``cooldown`` checks after a re-partition (the new stages' times must settle first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwright.plan.partition import imbalance, within_threshold

__all__ = ["ImbalanceDetector"]


@dataclass
class ImbalanceDetector:
    """Smoothed, hysteretic imbalance test on per-stage times.

    Args:
        threshold_rel: largest allowed ``(max - min) / max`` of the smoothed stage times.
        threshold_s: largest allowed ``max - min`` in seconds (None: not checked).
        smoothing: weight of the newest observation in the moving average (0 < w <= 1).
        patience: consecutive unbalanced checks needed to declare imbalance.
        cooldown: checks ignored after :meth:`repartitioned`.
    """

    threshold_rel: float | None = 0.1
    threshold_s: float | None = None
    smoothing: float = 0.3
    patience: int = 3
    cooldown: int = 5
    smoothed: list[float] | None = field(default=None, init=False)
    _strikes: int = field(default=0, init=False)
    _quiet: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing = {self.smoothing} must be in (0, 1]")
        if self.patience < 1 or self.cooldown < 0:
            raise ValueError(f"patience = {self.patience} must be >= 1 and cooldown = "
                             f"{self.cooldown} >= 0")
        within_threshold([], self.threshold_s, self.threshold_rel)  # validates thresholds

    def observe(self, stage_times: list[float], migrating: bool = False) -> bool:
        """Feed one check's per-stage times; True when imbalance is declared now.

        Args:
            stage_times: forward + backward seconds per stage (same length every call
                until :meth:`repartitioned`).
            migrating: a migration is under way; the observation is ignored.

        Returns:
            True at most once per imbalance episode: the caller re-partitions and calls
            :meth:`repartitioned`.
        """
        if migrating:
            return False
        if self.smoothed is None or len(self.smoothed) != len(stage_times):
            self.smoothed = list(stage_times)
        else:
            w = self.smoothing
            self.smoothed = [(1 - w) * s + w * t for s, t in zip(self.smoothed, stage_times,
                                                                  strict=True)]
        raw_ok = within_threshold(stage_times, self.threshold_s, self.threshold_rel)
        self._strikes = 0 if raw_ok else self._strikes + 1
        if self._quiet > 0:
            self._quiet -= 1
            return False
        if self._strikes < self.patience or within_threshold(
                self.smoothed, self.threshold_s, self.threshold_rel):
            return False
        self._strikes = 0
        self._quiet = self.cooldown  # no second decision before this one is applied
        return True

    def repartitioned(self) -> None:
        """The partition changed: forget the old stage times and wait ``cooldown`` checks."""
        self.smoothed = None
        self._strikes = 0
        self._quiet = self.cooldown

    @property
    def imbalance(self) -> float:
        """``(max - min) / max`` of the smoothed stage times (0 before any observation)."""
        return imbalance(self.smoothed or [])
