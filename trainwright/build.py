"""Build the model layers, optimizer, loss and data a configuration describes.

The distributed worker and the single-process reference both build through here, so the
two start from identical weights and read identical batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainwright.config import Config
from trainwright.data import CharCorpus, SyntheticRegression, SyntheticTokens, stdlib_corpus
from trainwright.models import GPTConfig, gpt_layers, mlp_layers

__all__ = ["build_layers", "build_optimizer", "build_data", "loss_fn", "split_microbatches"]


def build_layers(cfg: Config) -> list[tuple[str, nn.Module]]:
    """The whole model as ``(name, layer)`` pairs, initialised from ``train.seed``."""
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    if m.name == "gpt":
        layers = gpt_layers(GPTConfig(vocab=256, context=m.context, d_model=m.d_model,
                                      n_heads=m.n_heads, n_blocks=m.n_blocks))
        names = ["embed", *(f"block{i}" for i in range(m.n_blocks)), "head"]
    else:
        layers = mlp_layers(m.d_in, m.d_model, m.n_classes, m.n_blocks)
        names = [*(f"hidden{i}" for i in range(m.n_blocks)), "out"]
    return list(zip(names, layers, strict=True))


def build_optimizer(cfg: Config, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """The configured optimizer over ``params`` (None when there are no parameters)."""
    if not params:
        return None
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def build_data(cfg: Config):
    """The dataset: an object with ``batch(step, batch_size) -> (inputs, targets)``."""
    m, seed = cfg.model, cfg.train.seed
    if m.name == "mlp":
        return SyntheticRegression(m.d_in, m.n_classes, seed=seed)
    if cfg.data.name == "synthetic":
        return SyntheticTokens(256, m.context, seed=seed)
    return CharCorpus(stdlib_corpus(cfg.data.max_bytes), m.context, seed=seed)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits ``(..., C)``, targets ``(...)``."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def split_microbatches(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Split along dimension 0 into ``n`` equal contiguous micro-batches."""
    return [c.contiguous() for c in t.chunk(n)]
