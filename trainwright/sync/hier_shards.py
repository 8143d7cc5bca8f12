"""The shard files of the hierarchical sync: writing one rank's slice and its
optimizer state (:func:`write_shard`), reading the parts that overlap another slice
(:func:`read_overlap`, so a run may resume at another rank count), which shards tile the
flat parameter vector, and the full vector rebuilt in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["write_shard", "slice_state", "read_overlap", "covering_shards", "assemble_flat"]


def covering_shards(directory: str | Path, numel: int) -> list[dict]:
    """The index entries of one node's shards that tile ``[0, numel)``."""
    metas = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("shard_*.json"))]
    if not metas:
        raise FileNotFoundError(f"no shard_*.json in {directory}; was it written by "
                                f"HierarchicalSync.save_shard?")
    if metas[0]["numel"] != numel:
        raise ValueError(f"shards in {directory} hold {metas[0]['numel']} parameters, the model "
                         f"has {numel}; they belong to a different model")
    node0 = sorted((m for m in metas if m["node"] == 0), key=lambda m: m["lo"])
    edge = 0
    for m in node0:
        if m["lo"] != edge:
            break
        edge = m["hi"]
    if edge != numel:
        raise FileNotFoundError(f"the shards of node 0 in {directory} cover [0, {edge}) of "
                                f"{numel} parameters; a shard file is missing")
    return node0


def assemble_flat(directory: str | Path) -> torch.Tensor:
    """The full flat parameter vector from a directory of shards (one process, no group)."""
    metas = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("shard_*.json"))]
    if not metas:
        raise FileNotFoundError(f"no shard_*.json in {directory}")
    numel = metas[0]["numel"]
    out = None
    for m in covering_shards(directory, numel):
        saved = torch.load(Path(directory) / f"shard_{m['rank']:05d}.pt", map_location="cpu",
                           weights_only=True)
        if out is None:
            out = torch.empty(numel, dtype=saved["params"].dtype)
        out[m["lo"] : m["hi"]].copy_(saved["params"])
    return out


def write_shard(directory: str | Path, meta: dict, params: torch.Tensor, optim: dict) -> Path:
    """Write ``directory/shard_RANK.pt`` (the slice ``params`` and its optimizer state) and
    its ``.json`` index ``meta`` (``rank``, ``node``, ``local``, ``lo``, ``hi``, ``numel``),
    each atomically."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rank = meta["rank"]
    path = d / f"shard_{rank:05d}.pt"
    torch.save({**meta, "params": params.detach().clone(), "optim": optim},
               d / f".shard_{rank:05d}.pt.tmp")
    os.replace(d / f".shard_{rank:05d}.pt.tmp", path)
    tmp = d / f".shard_{rank:05d}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, d / f"shard_{rank:05d}.json")
    return path


def slice_state(optimizer, n_pieces: int) -> dict:
    """An optimizer's state over ``n_pieces`` sub-shards, as if one parameter held the whole
    slice (per-element tensors joined; scalars such as Adam's step taken once)."""
    if optimizer is None:
        return {"state": {}, "param_groups": []}
    sd = optimizer.state_dict()
    per_piece = [sd["state"].get(i, {}) for i in range(n_pieces)]
    merged: dict = {}
    for key, t in per_piece[0].items():
        if isinstance(t, torch.Tensor) and t.dim() == 1:
            merged[key] = torch.cat([st[key].reshape(-1) for st in per_piece])
        else:  # e.g. Adam's step count: equal for every piece
            merged[key] = t
    groups = [{**sd["param_groups"][0], "params": [0]}]
    return {"state": {0: merged} if per_piece[0] else {}, "param_groups": groups}


def read_overlap(directory: str | Path, flat: torch.Tensor, lo: int,
                 hi: int) -> tuple[dict, list | None]:
    """Copy into ``flat[lo:hi]`` the parameters of every shard in ``directory`` overlapping
    it; returns the optimizer state over ``[lo, hi)`` (per-element tensors assembled from
    the overlaps, scalars as saved) and the saved param groups (None: no overlap)."""
    new_state: dict = {}
    groups_state = None
    for meta in covering_shards(directory, flat.numel()):
        a, b = max(lo, meta["lo"]), min(hi, meta["hi"])
        if b <= a:
            continue
        saved = torch.load(Path(directory) / f"shard_{meta['rank']:05d}.pt",
                           map_location=flat.device, weights_only=True)
        with torch.no_grad():
            flat[a:b].copy_(saved["params"][a - meta["lo"] : b - meta["lo"]])
        groups_state = saved["optim"]["param_groups"]
        for key, t in saved["optim"]["state"].get(0, {}).items():
            if isinstance(t, torch.Tensor) and t.shape == (meta["hi"] - meta["lo"],):
                buf = new_state.setdefault(key, torch.zeros(hi - lo, dtype=t.dtype,
                                                            device=t.device))
                buf[a - lo : b - lo].copy_(t[a - meta["lo"] : b - meta["lo"]])
            else:
                new_state[key] = t
    return new_state, groups_state
