"""The layers of a run that edited its model (``rebalance.edits``), rebuilt for loading.

A checkpoint written after a model edit holds the edited model's layers under their new
indices; :func:`edited_layers` replays the edit hook on the factory's layers, step by step
and seeded as the trainer seeds it, so that :func:`trainwright.load_model` reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from trainwright.pipeline.edit import InsertLayer, RemoveLayer, load_edit_hook

__all__ = ["edited_layers"]


def edited_layers(named: list[tuple[str, nn.Module]], edits: str, seed: int,
                  step: int) -> list[tuple[str, nn.Module]]:
    """``named`` after the edits the hook ``edits`` made before steps ``1 .. step``.

    Args:
        named: (name, layer) as the model factory builds them.
        edits: the ``rebalance.edits`` hook, ``"module:function"``.
        seed: ``train.seed`` (each insert is built under ``torch.manual_seed(seed + step)``).
        step: the checkpoint's step.
    """
    hook, named = load_edit_hook(edits), list(named)
    for s in range(1, step + 1):
        for e in hook(s):
            if isinstance(e, InsertLayer):
                torch.manual_seed(seed + s)
                named.insert(e.at, (e.name, e.build()))
            elif isinstance(e, RemoveLayer):
                del named[e.index]
            else:
                raise TypeError(f"unknown model edit {e!r}; use InsertLayer or RemoveLayer")
    return named
