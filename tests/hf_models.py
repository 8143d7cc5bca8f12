"""Tiny random-weight Hugging Face models (no download) for ``model.factory``.

Each factory returns ``(model, example_args)``; the pipeline cuts it at its blocks.
Dropout is off so that the pipeline and the single-process reference see the same maths.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256  # the synthetic token data (``data.name = "synthetic"``) draws bytes


def _example(cfg) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, cfg.model.context)),)


def gpt2_config(cfg):
    """A 2-block GPT-2 (learned positions, LayerNorm, fused qkv, ``lm_head`` tied to ``wte``)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=cfg.model.context, n_embd=32, n_layer=2,
                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


def llama_config(cfg, tied: bool = False):
    """A 2-block Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 KV)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=cfg.model.context, tie_word_embeddings=tied,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gpt2(cfg):
    """``GPT2LMHeadModel`` (returns a ``CausalLMOutputWithCrossAttentions``)."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(cfg)), _example(cfg)


def llama(cfg):
    """``LlamaForCausalLM``, untied."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(cfg)), _example(cfg)


def llama_tied(cfg):
    """``LlamaForCausalLM`` with ``tie_word_embeddings``: it has no biases, so AdamW compares
    tightly. GPT-2's fused qkv bias holds the key bias, whose gradient is zero in exact
    arithmetic; Adam turns float noise there into full-size steps (tests/test_pipeline.py
    notes the same for the built-in GPT), so GPT-2 is compared with SGD."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(cfg, tied=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, _example(cfg)


class TupleOut(nn.Module):
    """Returns ``(logits, hidden)``: the first item is trained on."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h), h


class NoTensor(nn.Module):
    """Returns a dict of a string: no tensor to train on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x)
        return {"note": "nothing here"}


def tuple_out(cfg):
    """A model whose forward returns a tuple."""
    return TupleOut(), _example(cfg)


def no_tensor():
    """A model whose forward returns no tensor (refused)."""
    return NoTensor(), (torch.randn(2, 4),)


class TiedHead(nn.Module):
    """Output projection that uses the embedding's weight (the same ``nn.Parameter``)."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.weight = embed.weight

    def forward(self, h):
        return h @ self.weight.t()


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, d: int):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.lin(self.norm(h)))


class SoftCap(nn.Module):
    """``c * tanh(logits / c)`` (a logit soft-cap): a layer after the tied head, so that the
    head is not pinned to the last stage and can migrate."""

    def __init__(self, cap: float = 30.0):
        super().__init__()
        self.cap = cap

    def forward(self, logits):
        return self.cap * torch.tanh(logits / self.cap)


def tied_sequential(cfg):
    """embed, 3 blocks, head tied to embed, soft-cap: 6 layers, one tie (layers 0 and 4)."""
    embed = nn.Embedding(VOCAB, 16)
    return nn.Sequential(embed, Block(16), Block(16), Block(16), TiedHead(embed), SoftCap())
