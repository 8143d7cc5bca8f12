"""Single-process reference training: the oracle every parallel mode is tested against.

It trains ``nn.Sequential(*layers)`` on the whole global batch of each step with one
optimizer, exactly what a user would write without trainwright.
"""

from __future__ import annotations

from torch import nn

from trainwright.config import Config
from trainwright.model.build import build_data, build_layers, build_optimizer, loss_fn

__all__ = ["train_reference"]


def train_reference(cfg: Config, steps: int | None = None,
                    layers: list[nn.Module] | None = None) -> tuple[nn.Sequential, list[float]]:
    """Train the configured model for ``steps`` (default ``train.steps``) in one process.

    ``layers`` replaces the model the config builds (the same layers the parallel run got).

    Returns:
        The trained model (its children are the layers, in order) and the loss per step.
    """
    if layers is None:
        layers = [layer for _, layer in build_layers(cfg)]
    model = nn.Sequential(*layers)
    opt = build_optimizer(cfg, list(model.parameters()))
    data = build_data(cfg)
    criterion = loss_fn(cfg)
    losses = []
    for step in range(1, (steps or cfg.train.steps) + 1):
        x, y = data.batch(step, cfg.train.batch_size)
        loss = criterion(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses
