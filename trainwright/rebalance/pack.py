"""A migration's wire format: nested tensors and plain values packed into two uint8 tensors.

A migration package (parameters, stored inputs, RNG states; later gradients and optimizer
state) is a tree of dicts, lists and tuples. :func:`pack_tree` sends it as two messages,
each checked by the P2P headers: the pickled structure with tensor descriptions, and every
tensor's bytes one after another, aligned; :func:`unpack_tree` rebuilds it on the receiver.
"""

from __future__ import annotations

import pickle

import torch

__all__ = ["pack_tree", "unpack_tree"]

_ALIGN = 64


class _Slot:
    """Placeholder for the n-th tensor in a packed tree."""

    def __init__(self, n: int):
        self.n = n


def _strip(obj, tensors: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj, tensors: list):
    if isinstance(obj, _Slot):
        return tensors[obj.n]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def pack_tree(obj, device: torch.device) -> list[torch.Tensor]:
    """Pack nested dicts/lists/tuples of tensors and plain values into two uint8 tensors.

    Returns ``[skeleton, blob]``: the pickled structure with tensor descriptions (CPU), and
    every tensor's bytes one after another (on ``device``, aligned), so a package of any
    size is two messages with the P2P header checks.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _strip(obj, tensors)
    metas, parts, offset = [], [], 0
    for t in tensors:
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        raw = t.reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8,
                                                                          device=t.device)
        pad = (-nbytes) % _ALIGN
        parts.append(raw.to(device))
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        metas.append((offset, nbytes, t.dtype, tuple(t.shape), t.requires_grad))
        offset += nbytes + pad
    blob = torch.cat(parts) if parts else torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
    head = torch.frombuffer(bytearray(pickle.dumps((skeleton, metas))), dtype=torch.uint8)
    return [head.to(device), blob]


def unpack_tree(packed: list[torch.Tensor], device: torch.device):
    """Inverse of :func:`pack_tree`; tensors are fresh copies on ``device``."""
    head, blob = packed
    skeleton, metas = pickle.loads(head.cpu().numpy().tobytes())
    tensors = []
    for offset, nbytes, dtype, shape, _ in metas:
        raw = blob[offset:offset + nbytes]
        t = raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        tensors.append(t.to(device).clone())
    return _fill(skeleton, tensors)
