"""User-style model and data factories, loaded by config (``model.factory``, ``data.factory``)."""

from __future__ import annotations

import torch
from torch import nn


class SkipNet(nn.Module):
    """enc1 -> enc2 -> mid -> dec (adds enc1's output back): a long skip across stages."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.enc2 = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.mid = nn.Linear(d, d)
        self.dec = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        return self.dec(self.mid(self.enc2(e1)) + e1)


def skipnet():
    """The model and example inputs for ``torch.export`` capture."""
    return SkipNet(), (torch.randn(4, 16),)


def sequential_mlp():
    """A plain ``nn.Sequential``: each child is a layer."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


class Regression:
    """Fixed-seed regression batches: ``batch(step, n) -> (x (n, 16), y (n, 4))``."""

    def __init__(self, cfg):
        self.seed = cfg.train.seed

    def batch(self, step: int, n: int):
        """The global batch of ``step``."""
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        x = torch.randn(n, 16, generator=g)
        return x, torch.sin(x[:, :4]) + 0.1 * x[:, 4:8]


class Heavy(nn.Module):
    """A shape-preserving layer that costs ``reps`` small matmuls (rebalancing tests)."""

    def __init__(self, d: int = 32, reps: int = 16):
        super().__init__()
        self.lin, self.reps = nn.Linear(d, d), reps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = x + 0.01 * torch.tanh(self.lin(x))
        return x


def insert_heavy(step: int) -> list:
    """Edit hook: a heavy layer joins stage 0 (after the embedding) before step 3."""
    from trainwright.rebalance.edits import InsertLayer

    if step == 3:
        return [InsertLayer(at=1, build=lambda: Heavy(32, 24), name="heavy")]
    return []


class _Statistic(nn.Module):
    """Returns a Python number (``.item()``), not a tensor."""

    def forward(self, x: torch.Tensor) -> float:
        return x.abs().mean().item()


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x) * scale


class NumberAcrossLayers(nn.Module):
    """One top-level submodule hands the next a Python number: not a pipeline layer cut."""

    def __init__(self):
        super().__init__()
        self.stat, self.head = _Statistic(), _Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x, self.stat(x))


def number_across_layers():
    """A model whose cut would pass a Python number between layers (refused at start)."""
    return NumberAcrossLayers(), (torch.randn(4, 16),)


class PosTable(nn.Module):
    """Adds the first ``T`` rows of a position table to ``x (B, T, d)``: an ``nn.Embedding``
    in the middle of the model (row-sparse gradient: ``T`` of ``rows`` rows), so it can
    migrate between stages (sparse sync tests)."""

    def __init__(self, rows: int = 64, d: int = 32):
        super().__init__()
        self.pos = nn.Embedding(rows, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


def token_model(cfg):
    """tokens -> embedding -> position table -> 2 x (linear, tanh) -> logits (5 layers)."""
    from collections import OrderedDict

    d = cfg.model.d_model
    return nn.Sequential(OrderedDict(
        tok=nn.Embedding(256, d), pos=PosTable(4 * cfg.model.context, d),
        mix1=nn.Sequential(nn.Linear(d, d), nn.Tanh()),
        mix2=nn.Sequential(nn.Linear(d, d), nn.Tanh()), head=nn.Linear(d, 256)))


def regression_datasets(cfg):
    """A ``(train, validation)`` pair of ``TensorDataset``\\ s of ``Regression``-style rows."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(cfg.train.seed)
    x = torch.randn(100, 16, generator=g)
    y = torch.sin(x[:, :4]) + 0.1 * x[:, 4:8]
    return TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])
