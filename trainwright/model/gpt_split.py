"""The built-in GPT cut the way a real transformer's layers differ: attention and MLP apart.

:func:`split_gpt_layers` returns ``[embed, attn0, mlp0, attn1, mlp1, ..., head]``. Each
attention layer is ``x + proj(attention(ln1(x)))`` and each MLP layer
``x + out(gelu(fc(ln2(x))))``, so the model computes exactly what
:func:`~trainwright.model.gpt.gpt_layers` computes, block by block, but a memory policy
(or a peer's ``torch.utils.checkpoint``) can treat the two halves differently: the MLP
saves about twice the attention's bytes (its 4x-wide hidden activations) for a similar
recompute time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainwright.model.gpt import Embedding, GPTConfig, Head

__all__ = ["Attention", "MLP", "split_gpt_layers"]


class Attention(nn.Module):
    """Pre-norm causal self-attention with its residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Pre-norm 4x MLP with its residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def split_gpt_layers(cfg: GPTConfig) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` pairs: embed, then ``attn{i}`` and ``mlp{i}`` per block, then head."""
    out: list[tuple[str, nn.Module]] = [("embed", Embedding(cfg))]
    for i in range(cfg.n_blocks):
        out += [(f"attn{i}", Attention(cfg)), (f"mlp{i}", MLP(cfg))]
    return [*out, ("head", Head(cfg))]
