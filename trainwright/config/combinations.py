"""Rules on how a run is started: combinations that a valid configuration can still not be
started with, checked before any process starts.

:meth:`Config.validate <trainwright.config.core.Config.validate>` checks the keys; these rules
also depend on how the run starts: the entry point (``trainwright run``, one rank of a
``torchrun`` job, or :func:`trainwright.fit`; every entry point starts every strategy today,
the token ring included) and whether the run resumes. Each refusal names why and what to use
instead (``docs/combinations.md`` lists every pair of features).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwright.errors import ConfigError

Config = Any  # trainwright.config.core.Config, which imports this module

__all__ = ["ENTRY_POINTS", "check_start", "check_ring"]

ENTRY_POINTS = ("cli", "torchrun", "fit")
"""``trainwright run`` on local processes, one rank of a torchrun/SLURM job, the Python API."""

RING_STAGES = ("sync.strategy = 'tokenring' trains the whole model on every node, so "
               "there are no stages to {what}; remove {keys}, or use sync.strategy = 'dense' "
               "with a pipeline")


def edited_at(run_dir: str | Path | None) -> int | None:
    """The first step at which a run edited its model (``rebalance.edits``, from its
    metrics.jsonl), else None. A live migration alone resumes: checkpoints hold the
    partition reached."""
    path = Path(run_dir) / "metrics.jsonl" if run_dir is not None else None
    if path is None or not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if row.get("kind") == "model_edit":
            return int(row.get("step", 0))
    return None


def check_ring(cfg: Config) -> None:
    """Features of the pipeline that a token ring (one stage per node) cannot have."""
    rb, mem = cfg.rebalance, cfg.memory
    if rb.enabled or rb.at_step or rb.edits:
        raise ConfigError(RING_STAGES.format(what="migrate layers between", keys=(
            "rebalance.enabled, rebalance.at_step and rebalance.edits")))
    if mem.peer_swap:
        raise ConfigError(RING_STAGES.format(what="lend activation memory to",
                                             keys="memory.peer_swap"))


def check_start(cfg: Config, *, via: str, resume: bool = False,
                run_dir: str | Path | None = None) -> None:
    """Refuse a valid configuration that cannot be started this way.

    Args:
        cfg: the validated configuration.
        via: the entry point, one of :data:`ENTRY_POINTS`.
        resume: whether the run continues from a checkpoint.
        run_dir: the run directory a resume continues (its metrics say whether the model
            was edited).

    Raises:
        ConfigError: the combination is not supported; the message names the alternative.
    """
    if via not in ENTRY_POINTS:
        raise ValueError(f"via must be one of {ENTRY_POINTS}, not {via!r}")
    step = edited_at(run_dir) if resume else None
    if step is not None:
        raise ConfigError(f"--resume {run_dir}: this run edited its model at step {step} "
                          f"(rebalance.edits), and a resumed run rebuilds the model from "
                          f"model.factory, which its later checkpoints do not match; start a "
                          f"new run")
