"""A plain MLP as an ordered list of layers, for tests and quick runs."""

from __future__ import annotations

from torch import nn

__all__ = ["mlp_layers"]


def mlp_layers(d_in: int, d_hidden: int, d_out: int, n_hidden: int) -> list[nn.Module]:
    """Build ``[Linear+GELU] * n_hidden + [Linear]``: ``n_hidden + 1`` layers.

    Args:
        d_in: input features.
        d_hidden: width of every hidden layer.
        d_out: output features (classes).
        n_hidden: number of hidden layers.

    Returns:
        The layers in execution order.
    """
    layers: list[nn.Module] = []
    width = d_in
    for _ in range(n_hidden):
        layers.append(nn.Sequential(nn.Linear(width, d_hidden), nn.GELU()))
        width = d_hidden
    layers.append(nn.Linear(width, d_out))
    return layers
