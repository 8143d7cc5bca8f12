"""Every layer's structure on every rank, so a receiver or a model edit can build any layer.

Parameters live only where a layer is placed; :class:`LayerCatalog` keeps a meta-device
copy of every layer (and its name) by model index, which live migration
(:mod:`~trainwright.rebalance.migration`) and model edits (:mod:`~trainwright.rebalance.edits`)
keep in step with the model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["LayerCatalog"]


class LayerCatalog:
    """Every layer of the model by index: real modules where placed, meta copies elsewhere.

    A receiver builds a migrating layer from its meta copy (``to_empty`` on its device,
    then the giver's parameters), which is how "the layer's structure" is known everywhere
    without holding every layer's weights.
    """

    def __init__(self, named: list[tuple[str, nn.Module]]):
        self.names = [n for n, _ in named]
        self.meta = [copy.deepcopy(m).to("meta") for _, m in named]

    def build(self, index: int, device: torch.device) -> nn.Module:
        """An empty (uninitialised) module of layer ``index`` on ``device``."""
        return copy.deepcopy(self.meta[index]).to_empty(device=device)

    def shapes(self, index: int) -> list[int]:
        """Flattened ``[numel, ...]`` of the layer's state, to check both sides agree."""
        return [t.numel() for t in self.meta[index].state_dict().values()]
