"""Rules on how a run is started: combinations that a valid configuration can still not be
started with, checked before any process starts.

:meth:`Config.validate <trainwright.config.core.Config.validate>` checks the keys; these rules
also depend on the entry point (``trainwright run``, one rank of a ``torchrun`` job, or
:func:`trainwright.fit`) and on whether the run resumes. Each refusal names why and what to
use instead (``docs/combinations.md`` lists every pair of features).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainwright.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from trainwright.config.core import Config

__all__ = ["ENTRY_POINTS", "check_start"]

ENTRY_POINTS = ("cli", "torchrun", "fit")
"""``trainwright run`` on local processes, one rank of a torchrun/SLURM job, the Python API."""

RING_VIA_FIT = ("sync.strategy = 'tokenring' runs through its own node launcher, which "
                "trainwright.fit does not start yet; run `trainwright run --set "
                "sync.strategy=tokenring`, or use sync.strategy = 'dense' with fit")
RING_UNDER_TORCHRUN = ("sync.strategy = 'tokenring' under torchrun would start a separate "
                       "local ring on every rank; run `trainwright run` (it starts "
                       "tokenring.nodes node processes itself), or use sync.strategy = "
                       "'dense' or 'hierarchical' with torchrun")
RING_RESUME = ("--resume is not supported with sync.strategy = 'tokenring' (a ring run "
               "saves model.pt, not the per-step checkpoints a resume reads); start a new run")
EDITS_RESUME = ("--resume of a run with rebalance.edits is not supported: its checkpoints "
                "hold the edited model, which the resumed run cannot rebuild; start a new "
                "run, or resume without edits from a run that had none")


def check_start(cfg: Config, *, via: str, resume: bool = False) -> None:
    """Refuse a valid configuration that cannot be started this way.

    Args:
        cfg: the validated configuration.
        via: the entry point, one of :data:`ENTRY_POINTS`.
        resume: whether the run continues from a checkpoint.

    Raises:
        ConfigError: the combination is not supported; the message names the alternative.
    """
    if via not in ENTRY_POINTS:
        raise ValueError(f"via must be one of {ENTRY_POINTS}, not {via!r}")
    ring = cfg.sync.strategy == "tokenring"
    if ring and resume:
        raise ConfigError(RING_RESUME)
    if ring and via == "fit":
        raise ConfigError(RING_VIA_FIT)
    if ring and via == "torchrun":
        raise ConfigError(RING_UNDER_TORCHRUN)
    if resume and cfg.rebalance.edits:
        raise ConfigError(EDITS_RESUME)
