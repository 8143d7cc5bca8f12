"""Scalar loggers for rank 0's ``step`` and ``eval`` rows: TensorBoard and Weights & Biases.

``[observe] loggers = ["tensorboard", "wandb"]``. Each is an optional extra
(``pip install 'trainwright[tensorboard]'``, ``'trainwright[wandb]'``); the config refuses
one that is not installed (``ObserveConfig``), so a run never stops half-way for it.

* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` writing to
  ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``).
* ``wandb``: a run in ``RUN_DIR/wandb``, named after the run directory. ``WANDB_MODE`` is
  respected when set; when it is not, the run is *online* only if an API key is known
  (``WANDB_API_KEY``, or a ``wandb login`` entry in ``~/.netrc``) and *offline* otherwise,
  so a machine without an account or a network never blocks on a login prompt
  (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later).

Scalars are every number in a row except ``step`` and ``time``, as ``train/<key>`` for
``step`` rows and ``eval/<key>`` for ``eval`` rows, at the row's step.
"""

from __future__ import annotations

import logging
import netrc
import os
from enum import Enum
from pathlib import Path

__all__ = ["LoggerKind", "ScalarLoggers", "wandb_mode"]

log = logging.getLogger(__name__)


class LoggerKind(str, Enum):
    """A scalar logger ``[observe] loggers`` may name; the value is its Python module."""

    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


def wandb_mode(environ: dict | None = None, home: Path | None = None) -> str:
    """``WANDB_MODE`` if set; else ``"online"`` with a known API key, ``"offline"`` without."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    try:
        rc = netrc.netrc(str((home or Path.home()) / ".netrc"))
        return "online" if rc.authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def _scalars(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k not in ("step", "time") and isinstance(v, (int, float))
            and not isinstance(v, bool)}


class ScalarLoggers:
    """The loggers a run asked for, fed rank 0's rows.

    Args:
        kinds: ``observe.loggers``.
        run_dir: the run directory (their files go under it).
        config: the run's configuration as a dict (wandb's run config).
    """

    def __init__(self, kinds: list[str], run_dir: Path, config: dict):
        self._tb = self._wandb = None
        if LoggerKind.TENSORBOARD in kinds:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if LoggerKind.WANDB in kinds:
            import wandb
            mode = wandb_mode()
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "trainwright"),
                                     name=Path(run_dir).name, dir=str(run_dir), config=config,
                                     mode=mode, reinit="create_new")
            log.info("wandb run %s (%s) in %s", self._wandb.id, mode, run_dir)

    def log(self, kind: str, row: dict) -> None:
        """Log a ``step`` or ``eval`` row's numbers at its step."""
        prefix = "train" if kind == "step" else kind
        values = {f"{prefix}/{k}": v for k, v in _scalars(row).items()}
        step = int(row["step"])
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flush and close every logger."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
