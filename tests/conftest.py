"""Shared fixtures: small configurations that train in seconds."""

from __future__ import annotations

import pytest

from trainwright.config import load_config


def tiny_overrides(run_dir, **extra) -> list[str]:
    """``--set`` items for a 4-layer GPT on synthetic tokens, SGD, 3 steps, no report."""
    base = {
        "model.n_blocks": 2, "model.d_model": 32, "model.n_heads": 2, "model.context": 16,
        "data.name": '"synthetic"', "train.steps": 3, "train.batch_size": 16,
        "train.optimizer": '"sgd"', "train.lr": 0.1, "run.report": "false",
        "run.progress": "false", "run.dir": f'"{run_dir}"', "runtime.peer_timeout_s": 5.0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny(tmp_path):
    """Factory: ``tiny(**overrides) -> Config`` rooted in this test's tmp dir."""
    return lambda **extra: load_config(None, tiny_overrides(tmp_path / "runs", **extra))
