"""Hierarchical sync's sharded optimizer state, cut along parameters so it can leave the shards.

The owned slice of the flat parameter vector is held as *sub-shards*: one per (piece,
parameter) overlap, so every sub-shard lies inside one model parameter and has its own
optimizer state (its own Adam step counter: a layer inserted later starts at step 0 like
it would with its own optimizer). That makes the state convertible both ways:

* :func:`import_layer_state`: the layers' own optimizers (``LayerSlot.optimizer``, filled by
  a checkpoint or by a migration) -> the sub-shards this rank owns;
* :func:`export_layer_state`: the sub-shards of every rank of the node (gathered inside the
  node; all nodes hold the same slices) -> each layer's optimizer, in exactly the form a
  dense run keeps it, so checkpoints and migrations need no special case.
"""

from __future__ import annotations

import torch

from trainwright.dist import collective as coll

__all__ = ["sub_shards", "import_layer_state", "export_layer_state", "clear_layer_state"]

SubShard = tuple[int, int, int, int]
"""``(piece, parameter index, a, b)``: flat elements ``[a, b)``, inside one parameter."""


def sub_shards(pieces: list[tuple[int, int]], offsets: list[int],
               sizes: list[int]) -> list[SubShard]:
    """The overlaps of each piece ``[a, b)`` with each parameter ``[offsets[j], +sizes[j])``,
    in flat order (empty overlaps dropped)."""
    out = []
    for c, (a, b) in enumerate(pieces):
        for j, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
            lo, hi = max(a, off), min(b, off + n)
            if hi > lo:
                out.append((c, j, lo, hi))
    return out


def _is_elementwise(v, n: int) -> bool:
    """A state tensor shaped like a 1-D sub-shard of ``n`` elements (Adam's moments), as
    opposed to a 0-dim one (Adam's step) or a non-tensor."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n


def import_layer_state(hs, slots: list) -> int:
    """Slice the layers' optimizer state into ``hs``'s sub-shards, then clear it there (the
    sharded optimizer holds it from now on). Returns the number of sub-shards filled."""
    by_param = {}
    for slot in slots:
        if slot.optimizer is not None:
            for p in slot.module.parameters():
                st = slot.optimizer.state.get(p)
                if st:
                    by_param[id(p)] = st
    filled = 0
    for shard, (_, j, a, b) in zip(hs.shards, hs.shard_map, strict=True):
        p = hs.params[j]
        st = by_param.get(id(p))
        if st is None:
            continue
        la, lb = a - hs.offsets[j], b - hs.offsets[j]
        hs.optimizer.state[shard] = {
            k: (v.reshape(-1)[la:lb].clone() if isinstance(v, torch.Tensor)
                and v.shape == p.shape and (p.dim() > 0 or k != "step") else
                v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in st.items()}
        filled += 1
    clear_layer_state(slots)
    return filled


def clear_layer_state(slots: list) -> None:
    """Drop the state the layers' own optimizers hold (a sharded copy is authoritative)."""
    for slot in slots:
        if slot.optimizer is not None:
            slot.optimizer.state.clear()


def _gathered(hs) -> list[tuple[int, int, int, dict]]:
    """Every sub-shard state of this rank's node: ``(param, a, b, state)`` with ``[a, b)``
    relative to the parameter. A collective within the node."""
    mine = []
    if hs.optimizer is not None:
        for shard, (_, j, a, b) in zip(hs.shards, hs.shard_map, strict=True):
            st = hs.optimizer.state.get(shard)
            if st:
                off = hs.offsets[j]
                mine.append((j, a - off, b - off,
                             {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                              for k, v in st.items()}))
    g = hs.groups
    if g.layout.ranks_per_node == 1:
        return mine
    out: list = [None] * g.layout.ranks_per_node
    coll.all_gather_object(out, mine, group=g.intra_group)
    return [part for parts in out for part in parts]


def export_layer_state(hs, slots: list) -> None:
    """Put the full optimizer state of every parameter into its layer's own optimizer
    (gathered from the node's ranks). A collective within the node: every rank of the
    sync group calls it at the same point."""
    per_param: dict[int, list] = {}
    for j, a, b, st in _gathered(hs):
        per_param.setdefault(j, []).append((a, b, st))
    owner = {}
    for slot in slots:
        for p in slot.module.parameters():
            owner[id(p)] = slot.optimizer
    for j, parts in per_param.items():
        p = hs.params[j]
        opt = owner.get(id(p))
        if opt is None:
            continue
        full: dict = {}
        for a, b, st in parts:
            for k, v in st.items():
                if _is_elementwise(v, b - a):
                    buf = full.setdefault(k, torch.zeros(p.numel(), dtype=v.dtype))
                    buf[a:b].copy_(v)
                else:  # e.g. Adam's step: the same on every sub-shard of a parameter
                    full.setdefault(k, v.clone() if isinstance(v, torch.Tensor) else v)
        opt.state[p] = {k: (v.view(p.shape).to(p.device)
                            if isinstance(v, torch.Tensor) and v.numel() == p.numel()
                            and v.dim() == 1 else v)
                        for k, v in full.items()}
