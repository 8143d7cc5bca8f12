"""Find a model's block list and name layers around it (``model.group_by = "auto"``).

A *block list* is the ``nn.ModuleList`` that holds the repeated blocks of a model: Hugging
Face GPT-2's ``transformer.h``, Llama's ``model.layers``. :func:`find_block_list` picks the
list with the most items of one class (ties: the most parameters).

With ``"auto"``, when the block list sits inside a child module (``transformer``,
``model``), that holder is opened: each block is a layer, everything the model runs before
the first block (token and position embeddings, rotary tables, masks) is one layer named
``embed``, and everything after the last block (final norm, LM head) one named ``head``.
When the block list is a direct child of the model, or there is none, ``"auto"`` is
``"top"`` (one layer per top-level child, per item of a top-level ``ModuleList``).
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_block_list", "auto_key", "OUTSIDE", "name_outside_groups"]

OUTSIDE = "<outside>"
"""Group key of a node recorded in a module that is neither a block nor an opened holder."""


def find_block_list(model: nn.Module) -> str | None:
    """Dotted path of the model's block list, or None when it has no ``ModuleList`` of
    two or more modules of one class."""
    best: tuple[int, int, str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        n_params = sum(p.numel() for p in module.parameters())
        key = (len(module), n_params, path)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def auto_key(block_path: str, path: str) -> str | None:
    """The ``"auto"`` group of a node recorded in module ``path`` (``""``: the root).

    Returns:
        ``block_path.N`` for a node inside block N; None (glue, joins the previous group)
        for a node of the root or of a module holding the block list; :data:`OUTSIDE` for
        any other module (embeddings, final norm, head).
    """
    prefix = block_path + "."
    if path.startswith(prefix):
        return prefix + path[len(prefix):].split(".", 1)[0]
    if path == block_path or not path or prefix.startswith(path + "."):
        return None
    return OUTSIDE


def name_outside_groups(names: list[str]) -> list[str]:
    """Rename the groups of :data:`OUTSIDE` nodes: ``embed`` before the first block, ``head``
    after the last one, ``between`` in between (a repeated name gets ``#1``, ``#2``...)."""
    outside = [i for i, n in enumerate(names) if n.split("#")[0] == OUTSIDE]
    blocks = [i for i in range(len(names)) if i not in outside]
    first, last = (blocks[0], blocks[-1]) if blocks else (len(names), -1)
    out, seen = list(names), {}
    for i in outside:
        base = "embed" if i < first else "head" if i > last else "between"
        count = seen[base] = seen.get(base, -1) + 1
        out[i] = base if count == 0 else f"{base}#{count}"
    return out
