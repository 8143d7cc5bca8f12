"""The Python API in two calls: :func:`fit` trains, :func:`load_model` returns the weights.

``trainwright run`` goes through the same door: :func:`load_run_config`, then
:func:`run_job` (which :func:`fit` calls too) checks, creates the run directory and starts
the ranks, locally or as one rank of a torchrun job; the command only prints what the
returned :class:`RunOutcome` says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from trainwright.config import Config, load_config
from trainwright.config.combinations import check_start
from trainwright.errors import TrainwrightError
from trainwright.model.build import build_layers, check_data
from trainwright.pipeline.budget import check_limits
from trainwright.pipeline.stage import LayerSlot
from trainwright.pipeline.tied import check_ties
from trainwright.rebalance.edits import edited_layers
from trainwright.run import checkpoint
from trainwright.run.launch import create_run_dir, in_torchrun, launch_local
from trainwright.run.manifest import choose_resume

__all__ = ["fit", "load_model", "load_run_config", "run_job", "RunOutcome"]

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """How :func:`run_job` ended in this process: what ``trainwright run`` prints, and what
    :func:`fit` returns or raises."""

    code: int
    """The process exit code: 0; 1 for a failed local run; a rank's own code under torchrun."""
    run_dir: Path
    error: str = ""
    """What failed, one line (empty under torchrun: each rank has logged its own failure)."""
    warnings: list[str] = field(default_factory=list)
    """Nodes the token ring dropped; the run still succeeded."""
    names_outputs: bool = False
    """Whether this process announces the outputs: the local launcher; under torchrun rank
    0, or the ring node that saved the model."""
    report: Path | None = None
    """``report.html``, with ``run.report`` on (a token ring's is its host node's)."""
    model: Path | None = None
    """``model.pt``, the token ring's trained weights."""

    @property
    def ok(self) -> bool:
        """True when this process's part of the run succeeded."""
        return self.code == 0


def fit(config: str | Path | None = None, overrides: list[str] | tuple = (),
        resume: str | Path | None = None) -> Path:
    """Train on local ranks, as ``trainwright run`` does, and return the run directory.

    Args:
        config: a TOML file, or None for the defaults.
        overrides: ``"section.key=value"`` strings, e.g. ``["parallel.pp=4"]``.
        resume: a run directory to continue instead of starting a new run.

    With ``sync.strategy = "tokenring"`` the local token-ring launcher runs
    ``tokenring.nodes`` node processes instead (the run directory then holds the nodes'
    reports, ``checkpoints/`` and ``model.pt``). Called in a process of a torchrun job, this
    process trains as its rank (or ring node), as ``trainwright run`` does there.

    Returns:
        The run directory (metrics.jsonl, trace.json, report.html, checkpoints/).

    Raises:
        ConfigError: invalid configuration (nothing is started).
        TrainwrightError: a rank failed; the message names it.
    """
    resume_dir = Path(resume) if resume is not None else None
    cfg = load_run_config(config, overrides, resume_dir)
    outcome = run_job(cfg, resume_dir, via="fit")
    if not outcome.ok:
        raise TrainwrightError(outcome.error or f"this rank exited with code {outcome.code} "
                                                f"(its log says why); see {outcome.run_dir}")
    for line in outcome.warnings:
        log.warning("%s", line)
    return outcome.run_dir


def load_run_config(config: str | Path | None = None, overrides: list[str] | tuple = (),
                    resume: Path | None = None) -> Config:
    """The configuration of a run: ``config`` (or ``resume/config.toml``) with the overrides.

    In a process of a torchrun job a token ring has a node per process
    (``tokenring.nodes = WORLD_SIZE``).

    Raises:
        ConfigError: unreadable file, unknown key, wrong type, or an invalid combination.
    """
    path = resume / "config.toml" if resume is not None else config
    if in_torchrun():
        from trainwright.run.ring_torchrun import load_torchrun_config
        return load_torchrun_config(path, list(overrides))
    return load_config(path, list(overrides))


def run_job(cfg: Config, resume: Path | None = None, *, via: str = "fit",
            on_start: Callable[[Config, Path], None] | None = None) -> RunOutcome:
    """Check ``cfg``, then train: spawn the local ranks (or ring nodes) and wait for them,
    or, in a process of a torchrun job, be its rank (or ring node).

    Args:
        cfg: the configuration, from :func:`load_run_config`.
        resume: the run directory to continue from its latest checkpoint.
        via: the entry point outside torchrun, ``"fit"`` or ``"cli"``
            (:data:`~trainwright.config.combinations.ENTRY_POINTS`).
        on_start: called on a local launch once the run directory exists, before any
            process starts (``trainwright run`` prints its start line there).

    Returns:
        How this process's part of the run ended.

    Raises:
        ConfigError: ``cfg`` cannot be started, the run directory cannot be written, or
            ``resume`` has checkpoints and none is intact (nothing is started).
    """
    torchrun = in_torchrun()
    check_start(cfg, via="torchrun" if torchrun else via, resume=resume is not None,
                run_dir=resume)
    _preflight(cfg)
    ring = cfg.sync.strategy == "tokenring"  # its own launcher: no process group
    if resume is not None and (not torchrun or os.environ["RANK"] == "0"):
        choose_resume(resume)  # damaged checkpoints named and set aside; none intact: exit 2
    if torchrun:
        return _ring_node(cfg, resume) if ring else _rank(cfg, resume)
    run_dir = create_run_dir(cfg, resume)
    if on_start is not None:
        on_start(cfg, run_dir)
    return _launch_ring(cfg, run_dir, resume) if ring else _launch(cfg, run_dir, resume)


def _preflight(cfg: Config) -> None:
    """Checks that need the data opened or the model built (a factory model's layer count,
    memory limits, ties), before any process starts; a built-in model's layer count was
    checked with the config."""
    from trainwright.run.worker import resolve_device
    resolve_device(cfg)
    check_data(cfg)
    if not cfg.model.factory and not any(v is not None for v in cfg.stage_limits()):
        return
    named = build_layers(cfg)
    cfg.check_layers(len(named))
    if cfg.sync.strategy == "tokenring":  # the whole model on every node: no stages
        return
    check_limits(cfg, named)
    check_ties(cfg, named)


def _launch(cfg: Config, run_dir: Path, resume: Path | None) -> RunOutcome:
    """The local launcher: ``pp x dp`` ranks on this host."""
    from trainwright.run.worker import resume_hint

    result = launch_local(cfg, run_dir, resume=resume is not None)
    if not result.ok:
        return RunOutcome(1, run_dir, error=f"{result.message()}. Partial outputs are in "
                                            f"{run_dir}. {resume_hint(run_dir)}")
    return RunOutcome(0, run_dir, names_outputs=True, report=_report(cfg, run_dir))


def _rank(cfg: Config, resume: Path | None) -> RunOutcome:
    """One rank of a torchrun job; rank 0 creates the run directory unless it resumes."""
    from trainwright.run.worker import run_worker

    run_dir = create_run_dir(cfg, resume) if resume else None
    code, run_dir = run_worker(cfg, run_dir, resume=resume is not None)
    return RunOutcome(code, run_dir, names_outputs=code == 0 and os.environ["RANK"] == "0",
                      report=_report(cfg, run_dir))


def _launch_ring(cfg: Config, run_dir: Path, resume: Path | None) -> RunOutcome:
    """The local token-ring launcher: ``tokenring.nodes`` node processes on this host."""
    from trainwright.run.ring_launch import launch_ring

    result = launch_ring(cfg, run_dir, resume=resume is not None)
    if not result.ok:
        return RunOutcome(1, run_dir, error=f"token ring run failed: {result.message()}. "
                                            f"Outputs are in {run_dir}")
    return RunOutcome(0, run_dir, warnings=result.warnings(), names_outputs=True,
                      model=run_dir / "model.pt", report=_report(cfg, run_dir))


def _ring_node(cfg: Config, resume: Path | None) -> RunOutcome:
    """One token-ring node of a torchrun job; the node that saved the model names it."""
    from trainwright.run.ring_torchrun import run_torchrun_node

    code, run_dir, saved = run_torchrun_node(cfg, resume)
    return RunOutcome(code, run_dir, names_outputs=saved,
                      model=run_dir / "model.pt" if saved else None)


def _report(cfg: Config, run_dir: Path) -> Path | None:
    return run_dir / "report.html" if cfg.run.report else None


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
