"""What each stage puts into the placement search and the simulator, from the profile's
rows and a placement: memory per layer and tensor (:func:`stage_mems`), compute times and
bytes held, brought back and sent (:func:`stage_costs`), and the per-layer policy a
placement amounts to (:func:`placement_policies`)."""

from __future__ import annotations

from trainwright.plan.memory import LayerMem
from trainwright.plan.placement import HOST, Placement, StageMem, TensorInfo
from trainwright.plan.simulate import StageCost

__all__ = ["stage_mems", "stage_costs", "placement_policies"]


def stage_mems(layers: list, parts: list[list[int]], in_flight: list[int], n_micro: int,
               budgets: list, intervals: dict[int, float],
               rank_of: list[int] | None = None) -> list[StageMem]:
    """Placement input per stage, or per rank of several model chunks (``rank_of``: the
    rank of every model stage; each layer tagged with its chunk). ``input_bytes`` of a
    stage's last layer includes its output, which is held until backward, as
    :func:`trainwright.pipeline.budget.layer_mems`."""
    ranks = rank_of or list(range(len(parts)))
    out = []
    for r in range(len(in_flight)):
        mems, tensors = [], []
        for k in (k for k, rk in enumerate(ranks) if rk == r):
            idx = parts[k]
            for j, i in enumerate(idx):
                x = layers[i]
                extra = x.output_bytes if j == len(idx) - 1 else 0
                mems.append(LayerMem(i, sum(t.nbytes for t in x.tensors),
                                     x.input_bytes + extra, x.forward_s, x.backward_s, k))
                tensors += [TensorInfo(i, t.index, t.nbytes, intervals.get(i, 0.0))
                            for t in x.tensors]
        out.append(StageMem(r, in_flight[r], mems, tensors, budgets[r], n_micro))
    return out


def stage_costs(layers: list, parts: list[list[int]], placement: Placement | None,
                mapping: list[int], step_s: list, sync_s: list,
                rank_of: list[int] | None = None) -> list[StageCost]:
    """Simulator costs of each (model) stage under a placement (None: all kept).

    ``rank_of``: with several chunks per rank, the rank (index into ``placement.stages``)
    of every model stage; ``step_s`` / ``sync_s`` are then per model stage too."""
    stage_of_dev = {d: s for s, d in enumerate(mapping)}
    out = []
    for s, idx in enumerate(parts):
        rows = [layers[i] for i in idx]
        r = s if rank_of is None else rank_of[s]
        plans = {} if placement is None else {(t.layer, t.index): t
                                              for t in placement.stages[r].tensors}
        recomputed = {k[0] for k, t in plans.items() if t.policy == "recompute"}
        last_kept = idx[-1] not in recomputed  # a recomputed last layer holds no output
        held = sum(x.input_bytes for x in rows) + (rows[-1].output_bytes if last_kept else 0)
        per_layer: dict[int, int] = {}
        kept: dict[int, int] = {}
        host = 0
        peer: dict[int, int] = {}
        for i in idx:
            for t in layers[i].tensors:
                p = plans.get((i, t.index))
                if p is None or p.policy == "keep":
                    held += t.nbytes
                    kept[i] = kept.get(i, 0) + t.nbytes
                elif p.policy == "recompute":
                    per_layer[i] = per_layer.get(i, 0) + t.nbytes
                else:
                    for c in p.chunks:
                        if c.target == HOST:
                            host += c.nbytes
                            per_layer[i] = per_layer.get(i, 0) + c.nbytes
                        else:
                            t_stage = stage_of_dev[c.target]
                            peer[t_stage] = peer.get(t_stage, 0) + c.nbytes
        transient = _backward_extra(layers, idx, recomputed, kept, per_layer, last_kept)
        fwd = [x.forward_s for x in rows]
        bwd = [x.backward_s + (x.forward_s if i in recomputed else 0.0)
               for i, x in zip(idx, rows, strict=True)]
        out.append(StageCost(sum(fwd), sum(bwd), weight_s=sum(x.weight_s for x in rows),
                             send_bytes=rows[-1].output_bytes,
                             held_bytes=held, transient_bytes=transient,
                             w_held_bytes=sum(per_layer.values()),
                             host_bytes=host, peer_bytes=peer, step_s=step_s[s],
                             sync_s=sync_s[s], layer_forward_s=fwd, layer_backward_s=bwd))
    return out


def placement_policies(placement: Placement | None) -> dict[int, str]:
    """Layer -> ``recompute``, ``swap`` (a host-swapped tensor) or ``peer`` (a tensor sent
    to a peer) for every layer with a tensor not kept, the first of those winning; kept
    layers are left out."""
    rank = {"recompute": 0, "host": 1, "peer": 2}
    best: dict[int, str] = {}
    for sp in placement.stages if placement is not None else ():
        for t in sp.tensors:
            if t.policy in rank and (t.layer not in best or rank[t.policy] < rank[best[t.layer]]):
                best[t.layer] = t.policy
    return {i: "swap" if p == "host" else p for i, p in best.items()}


def _backward_extra(layers: list, idx: list[int], recomputed: set, kept: dict,
                    brought_back: dict, last_kept: bool) -> int:
    """Most bytes above the held ones while ``B(m)`` walks the layers back (the store's rule).

    Layer ``i``'s segment is released before its activations come back (recomputed or from
    the host): its kept tensors go, and so does the storage it shares with its neighbour
    once both are released (a layer's output is the next layer's input; a recomputed layer
    holds no output; the first layer's input is held by it alone).
    """
    released, extra = 0, 0
    for pos in range(len(idx) - 1, -1, -1):
        i = idx[pos]
        released += kept.get(i, 0)
        if pos == len(idx) - 1:
            released += layers[i].output_bytes if last_kept else 0
        elif i not in recomputed:  # its output (= next layer's input) is free now
            released += layers[idx[pos + 1]].input_bytes
        if pos == 0 or idx[pos - 1] in recomputed:  # nobody else holds this input
            released += layers[i].input_bytes
        extra = max(extra, brought_back.get(i, 0) - released)
    return extra
