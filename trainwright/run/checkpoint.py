"""Per-stage checkpoints keyed by layer, written atomically.

Layout: ``RUN_DIR/checkpoints/step_000120/stage_0.pt`` (one file per stage, written by
replica 0 of that stage) and ``RUN_DIR/checkpoints/latest`` naming the last complete one,
written by rank 0 only after every stage file is in place. State is keyed by the layer's
index in the whole model, so a checkpoint loads into any partition of the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainwright.pipeline.stage import LayerSlot

__all__ = ["stage_state", "save_stage", "mark_latest", "latest_step", "load_layers", "prune"]


def _dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def stage_state(slots: list[LayerSlot]) -> dict:
    """Model and optimizer state of a stage's layers, keyed by layer index."""
    return {
        "layers": {s.index: s.module.state_dict() for s in slots},
        "optim": {s.index: s.optimizer.state_dict() for s in slots if s.optimizer is not None},
    }


def save_stage(run_dir: Path, step: int, stage: int, slots: list[LayerSlot]) -> Path:
    """Write ``stage``'s state for ``step`` through a temporary file and a rename."""
    d = _dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"stage_{stage}.pt"
    tmp = d / f".stage_{stage}.pt.tmp"
    torch.save(stage_state(slots), tmp)
    os.replace(tmp, path)
    return path


def mark_latest(run_dir: Path, step: int) -> None:
    """Point ``latest`` at ``step`` (call after every stage file is written)."""
    ck = Path(run_dir) / "checkpoints"
    tmp = ck / ".latest.tmp"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, ck / "latest")


def latest_step(run_dir: Path) -> int | None:
    """Step of the last complete checkpoint, or None if there is none."""
    f = Path(run_dir) / "checkpoints" / "latest"
    return int(f.read_text().strip()) if f.exists() else None


def load_layers(run_dir: Path, step: int, slots: list[LayerSlot]) -> None:
    """Load model and optimizer state for ``slots`` from the checkpoint of ``step``.

    Raises:
        FileNotFoundError: the checkpoint lacks one of the layers (different model).
    """
    merged: dict = {"layers": {}, "optim": {}}
    for f in sorted(_dir(run_dir, step).glob("stage_*.pt")):
        state = torch.load(f, map_location="cpu", weights_only=True)
        merged["layers"].update(state["layers"])
        merged["optim"].update(state["optim"])
    for s in slots:
        if s.index not in merged["layers"]:
            raise FileNotFoundError(f"checkpoint step {step} in {run_dir} has no layer {s.index} "
                                    f"({s.name}); was it written by a different model?")
        s.module.load_state_dict(merged["layers"][s.index])
        if s.optimizer is not None and s.index in merged["optim"]:
            s.optimizer.load_state_dict(merged["optim"][s.index])


def prune(run_dir: Path, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    dirs = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    for d in dirs[:-keep]:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
