"""Reading the shard files that :meth:`HierarchicalSync.save_shard` writes (seed 003): which
shards tile the flat parameter vector, and the full vector rebuilt in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["covering_shards", "assemble_flat"]


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
