"""A tiny Llama for ``examples/llama-tiny.toml``: random weights, bytes as tokens.

``model.factory = "examples.llama_tiny:build"`` (run from the repository root). The
function returns ``(module, example_args)``; trainwright captures the module with
``torch.export`` and cuts it into pipeline layers.
"""

from __future__ import annotations

import torch


def build(cfg):
    """``LlamaForCausalLM`` with 4 blocks (RoPE, RMSNorm, SwiGLU, grouped-query attention)
    over the 256 byte values, and an example batch of ``model.context`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=cfg.model.d_model,
                         intermediate_size=4 * cfg.model.d_model,
                         num_hidden_layers=cfg.model.n_blocks,
                         num_attention_heads=cfg.model.n_heads, num_key_value_heads=2,
                         max_position_embeddings=cfg.model.context, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return LlamaForCausalLM(config), (torch.randint(0, 256, (2, cfg.model.context)),)
