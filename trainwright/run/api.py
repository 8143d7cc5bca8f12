"""The Python API in two calls: :func:`fit` trains, :func:`load_model` returns the weights."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from trainwright.config import load_config
from trainwright.config.combinations import check_start
from trainwright.errors import TrainwrightError
from trainwright.model.build import build_layers, check_data
from trainwright.pipeline.budget import check_limits
from trainwright.pipeline.stage import LayerSlot
from trainwright.pipeline.tied import check_ties
from trainwright.rebalance.edits import edited_layers
from trainwright.run import checkpoint

__all__ = ["fit", "load_model"]

log = logging.getLogger(__name__)


def fit(config: str | Path | None = None, overrides: list[str] | tuple = (),
        resume: str | Path | None = None) -> Path:
    """Train on local ranks, as ``trainwright run`` does, and return the run directory.

    Args:
        config: a TOML file, or None for the defaults.
        overrides: ``"section.key=value"`` strings, e.g. ``["parallel.pp=4"]``.
        resume: a run directory to continue instead of starting a new run.

    With ``sync.strategy = "tokenring"`` the local token-ring launcher runs
    ``tokenring.nodes`` node processes instead (the run directory then holds the nodes'
    reports, ``checkpoints/`` and ``model.pt``).

    Returns:
        The run directory (metrics.jsonl, trace.json, report.html, checkpoints/).

    Raises:
        ConfigError: invalid configuration (nothing is started).
        TrainwrightError: a rank failed; the message names it.
    """
    from trainwright.run.launch import create_run_dir, launch_local

    if resume is not None:
        cfg = load_config(Path(resume) / "config.toml", list(overrides))
    else:
        cfg = load_config(config, list(overrides))
    check_start(cfg, via="fit", resume=resume is not None, run_dir=resume)
    check_data(cfg)
    named = build_layers(cfg)
    cfg.check_layers(len(named))
    if cfg.sync.strategy == "tokenring":
        return _fit_ring(cfg, Path(resume) if resume else None)
    check_limits(cfg, named)
    check_ties(cfg, named)
    run_dir = create_run_dir(cfg, Path(resume) if resume else None)
    result = launch_local(cfg, run_dir, resume=resume is not None)
    if not result.ok:
        raise TrainwrightError(f"{result.describe(result.first_failure)}; see {run_dir}")
    return run_dir


def _fit_ring(cfg, resume: Path | None) -> Path:
    """:func:`fit` for ``sync.strategy = "tokenring"``: the local ring launcher."""
    from trainwright.run.launch import create_run_dir
    from trainwright.run.ring_launch import launch_ring

    run_dir = create_run_dir(cfg, resume)
    result = launch_ring(cfg, run_dir, resume=resume is not None)
    if not result.ok:
        raise TrainwrightError(f"token ring run failed: {result.message()}; see {run_dir}")
    for line in result.warnings():
        log.warning("%s", line)
    return run_dir


def load_model(run_dir: str | Path, step: int | None = None, *,
               original: bool = False) -> nn.Module:
    """The whole trained model of a run.

    Args:
        run_dir: a run directory.
        step: which checkpoint (default: the latest).
        original: return the module the model factory built (e.g. the ``transformers``
            model) with the trained weights, instead of ``nn.Sequential`` of the layers.
    """
    if original:
        from trainwright.run.export import trained_module
        return trained_module(run_dir, step)
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
    step = checkpoint.latest_step(run_dir) if step is None else step
    if step is None:
        raise TrainwrightError(f"{run_dir} has no checkpoint yet")
    named = build_layers(cfg)
    if cfg.rebalance.edits:  # the checkpoint holds the edited model
        named = edited_layers(named, cfg.rebalance.edits, cfg.train.seed, step)
    slots = [LayerSlot(i, n, m) for i, (n, m) in enumerate(named)]
    checkpoint.load_layers(run_dir, step, slots)
    return nn.Sequential(*(s.module for s in slots))
