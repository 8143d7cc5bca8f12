"""Per-layer tensor profiles of the built-in GPT, real or on the meta device (for the planner)."""

from __future__ import annotations

__all__ = ["gpt_profile"]


def gpt_profile(n_blocks: int, d_model: int, n_heads: int, context: int, vocab: int,
                micro_batch: int, meta: bool, dtype: str = "float32",
                flops_per_s: float = 312e12, bytes_per_s: float = 2e12) -> list:
    """Per-layer tensor profiles of the built-in GPT (``[embed, blocks..., head]``).

    On the meta device one block is profiled and repeated (every block is the same shape).
    """
    import torch

    from trainwright.model.gpt import Block, Embedding, GPTConfig, Head
    from trainwright.observe.tensor_profile import profile_tensors, profile_tensors_meta

    cfg = GPTConfig(vocab=vocab, context=context, d_model=d_model, n_heads=n_heads,
                    n_blocks=n_blocks)
    dt = getattr(torch, dtype)
    lossf = lambda out, t: torch.nn.functional.cross_entropy(  # noqa: E731
        out.float().flatten(0, 1), t.flatten())
    if not meta:
        from trainwright.model.gpt import gpt_layers
        torch.manual_seed(0)
        layers = [(f"layer{i}", m.to(dt)) for i, m in enumerate(gpt_layers(cfg))]
        x = torch.randint(0, vocab, (micro_batch, context))
        y = torch.randint(0, vocab, (micro_batch, context))
        return profile_tensors(layers, x, y, lossf)
    with torch.device("meta"):
        emb, block, head = Embedding(cfg).to(dt), Block(cfg).to(dt), Head(cfg).to(dt)
        x = torch.zeros(micro_batch, context, dtype=torch.long)
    rows = profile_tensors_meta([("embed", emb), ("block", block), ("head", head)], x,
                                flops_per_s, bytes_per_s, x, lossf)
    import copy
    out = [rows[0]] + [copy.deepcopy(rows[1]) for _ in range(n_blocks)] + [rows[2]]
    for i, r in enumerate(out):
        r.layer, r.name = i, ("embed" if i == 0 else "head" if i == n_blocks + 1
                              else f"block{i - 1}")
    return out
