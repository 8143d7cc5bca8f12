"""A small GPT as an ordered list of layers: embedding, pre-norm transformer blocks, head.

Every layer maps one tensor to one tensor, so any contiguous run of layers is a valid
pipeline stage. Dropout is left out on purpose: parallel runs are checked bit-for-bit
against a single-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "gpt_layers"]


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the built-in GPT."""

    vocab: int = 256
    """Vocabulary size (256: byte-level characters)."""
    context: int = 64
    """Sequence length the position table covers."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    n_blocks: int = 4
    """Transformer blocks between embedding and head."""


class Embedding(nn.Module):
    """Token plus learned position embedding: ids ``(B, T)`` -> ``(B, T, d_model)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(positions)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, each residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final layer norm and projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt_layers(cfg: GPTConfig) -> list[nn.Module]:
    """Build the GPT as ``[Embedding, Block x n_blocks, Head]``.

    Args:
        cfg: model shape.

    Returns:
        The layers in execution order; ``nn.Sequential(*layers)`` is the whole model.
    """
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    return [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_blocks)), Head(cfg)]
