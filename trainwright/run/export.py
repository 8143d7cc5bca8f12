"""Get a trained model out of a run: the user's own module with the trained weights, and
``trainwright export RUN_DIR --to DIR`` (safetensors under the model's own names).

Every rank builds the whole model from the run's ``config.toml``; the layers share the
parameter objects of the module they were cut from (:func:`~trainwright.model.build.build_model`),
so loading a checkpoint into the layers puts the trained weights into that module. Tied
weights live once in the module (each stage's copy was kept identical while training),
and ``transformers``' ``save_pretrained`` stores a tied weight once and re-ties it on load.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from trainwright.config import load_config
from trainwright.errors import ConfigError
from trainwright.model.build import build_model
from trainwright.model.hf import save_model_dir
from trainwright.pipeline.stage import LayerSlot
from trainwright.run import checkpoint

__all__ = ["trained_module", "export_run"]


def _checkpoint_step(run_dir: Path, step: int | None) -> int:
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no config.toml; pass the run directory "
                          f"that `trainwright run` printed")
    latest = checkpoint.latest_step(run_dir)
    if latest is None:
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} has no checkpoint yet; train first (or "
                          f"set run.checkpoint_every)")
    if step is not None and not (run_dir / "checkpoints" / f"step_{step:06d}").is_dir():
        raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of that step; the "
                          f"latest is {latest}")
    return latest if step is None else step


def trained_module(run_dir: str | Path, step: int | None = None) -> nn.Module:
    """The module the run's model factory returned, with the trained weights.

    For a built-in model, or a factory that returned a list of layers, it is an
    ``nn.Sequential`` of the layers.

    Raises:
        ConfigError: not a run directory, or no checkpoint (of ``step``).
    """
    run_dir = Path(run_dir)
    step = _checkpoint_step(run_dir, step)
    cfg = load_config(run_dir / "config.toml")
    named, module = build_model(cfg)
    checkpoint.load_layers(run_dir, step,
                           [LayerSlot(i, n, m) for i, (n, m) in enumerate(named)])
    return module


def export_run(run_dir: str | Path, to: str | Path, step: int | None = None) -> list[Path]:
    """Write the run's trained weights to folder ``to`` as safetensors, under the model's
    own parameter names; a ``transformers`` model as a ``from_pretrained`` folder
    (``config.json`` included).

    Returns:
        The files written.

    Raises:
        ConfigError: bad ``run_dir`` / ``step``, or ``to`` exists and is not an empty
            folder (nothing is written then).
    """
    to = Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"--to {str(to)!r} exists and is not an empty folder; give a new "
                          f"or empty folder")
    _checkpoint_step(Path(run_dir), step)
    return save_model_dir(trained_module(run_dir, step), to)
