"""Split a layer chain into clusters that a pipeline partition never cuts.

The adaptive pipeline walks the layers in execution order: a *cluster* starts at a
layer whose output feeds several layers (a fork), ends at the layer that joins them, and
the straight runs outside such regions are clusters of their own. Here each straight-run
layer is its own cluster (the finest choice, best for partitioning), and overlapping or
nested fork/join regions merge into one cluster.

Layer graph. Layers ``0..n-1`` run in execution order; an edge ``(p, c)`` says layer ``c``
uses a value made by layer ``p`` (``p == -1``: a model input). The cut *after layer i*
lies between layers ``i`` and ``i + 1``. An edge ``(p, c)`` with ``c > p + 1`` is a skip;
it *bypasses* layers ``p+1 .. c-1``. The rule (default, ``keep_fork=False``):

    the cut after layer ``i`` is forbidden iff some edge ``(p, c)`` has ``p < i < c``,

i.e. iff a value made before layer ``i`` is used after it, so that the cut would carry
the skip next to the main path. A cut right after the fork carries only the fork's
output, as a chain cut does, so it stays allowed: the fork is the cluster's entry and the
join its last layer. With ``keep_fork=True`` (the literal rule) the fork joins the
cluster as well (``p <= i < c``); in a residual network the layer that ends one block
(the join, holding the add) is also the fork of the next, so this merges consecutive
blocks into one cluster.

Edges of a real model (``layer_edges``). Layers from ``trainwright.model.graph.layers_from_export``
are ``fx.GraphModule`` chains whose input and output are the frontier tuple; each frontier
slot is traced back to the layer that made it (a slot a layer only passes on keeps its
maker) and a slot a layer reads (other than for its shape) gives an edge. Values that carry
no gradient (attention masks, position ids, rotary tables: made from model inputs and
buffers only, or of integer/bool dtype) are left out by default, since every block reads
them and they would otherwise join the whole model into one cluster. Any other module (an
``nn.Sequential`` child) is opaque: it reads all of its input, so its edges form a chain.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn

__all__ = ["INPUT", "allowed_cuts", "clusters_from_layer_graph", "layer_edges",
           "model_clusters"]

INPUT = -1  # producer index standing for the model's inputs
_SHAPE_OPS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
              torch.ops.aten.sym_stride.int, torch.ops.aten.sym_storage_offset.default)


def _forbidden(n_layers: int, edges: Iterable[tuple[int, int]], keep_fork: bool) -> list[bool]:
    """Entry ``i``: whether the cut after layer ``i`` is forbidden (validates the input)."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, not {n_layers!r}")
    delta = [0] * (n_layers + 1)
    for edge in edges:
        if (not isinstance(edge, (tuple, list)) or len(edge) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in edge)):
            raise ValueError(f"an edge must be a pair of ints (producer, consumer), not {edge!r}")
        p, c = edge
        if not INPUT <= p < c < n_layers:
            raise ValueError(f"edge {edge!r}: need {INPUT} <= producer < consumer < "
                             f"n_layers={n_layers}")
        lo = max(p if keep_fork else p + 1, 0)
        if c > p + 1 and lo < c:  # a skip: cuts after lo .. c-1
            delta[lo] += 1
            delta[c] -= 1
    forbidden, open_skips = [], 0
    for i in range(n_layers - 1):
        open_skips += delta[i]
        forbidden.append(open_skips > 0)
    return forbidden


def allowed_cuts(n_layers: int, edges: Iterable[tuple[int, int]], *,
                 keep_fork: bool = False) -> list[int]:
    """The cuts a partition may use: ``i`` means between layer ``i`` and ``i + 1``.

    Args:
        n_layers: number of layers, in execution order.
        edges: ``(producer, consumer)`` pairs, any order, duplicates allowed; producer
            ``-1`` (``INPUT``) is a model input.
        keep_fork: also forbid the cut right after a fork (see the module docstring).

    Returns:
        The allowed cut positions in ``0 .. n_layers - 2``, ascending.

    Raises:
        ValueError: ``n_layers`` is not a positive int, or an edge is malformed or not
            ``-1 <= producer < consumer < n_layers``.
    """
    return [i for i, bad in enumerate(_forbidden(n_layers, edges, keep_fork)) if not bad]


def clusters_from_layer_graph(n_layers: int, edges: Iterable[tuple[int, int]], *,
                              keep_fork: bool = False) -> list[list[int]]:
    """Group layers into clusters: maximal runs of layers with no allowed cut inside.

    Args:
        n_layers: number of layers, in execution order.
        edges: ``(producer, consumer)`` pairs, any order, duplicates allowed; producer
            ``-1`` (``INPUT``) is a model input.
        keep_fork: keep each fork in the cluster of its join (the literal rule).

    Returns:
        Lists of consecutive layer indices that together cover ``0 .. n_layers - 1``.

    Raises:
        ValueError: as ``allowed_cuts``.
    """
    clusters, start = [], 0
    for i in allowed_cuts(n_layers, edges, keep_fork=keep_fork):
        clusters.append(list(range(start, i + 1)))
        start = i + 1
    clusters.append(list(range(start, n_layers)))
    return clusters


def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _measured_flags(layers: Sequence[nn.Module], example_input: Any) -> list[list[bool]]:
    """Run the chain once; entry k: which values entering layer k require grad."""
    buffers = {id(b): b for layer in layers for b in layer.buffers()}
    saved = {key: b.detach().clone() for key, b in buffers.items()}
    value = example_input
    flags = [[isinstance(t, torch.Tensor) and t.requires_grad for t in _flat(value)]]
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for layer in layers:
                out = _flat(layer(value))
                flags.append([isinstance(t, torch.Tensor) and t.requires_grad for t in out])
                out = [t.detach().requires_grad_(t.requires_grad)
                       if isinstance(t, torch.Tensor) else t for t in out]
                value = out[0] if len(out) == 1 else tuple(out)
    finally:
        with torch.no_grad():
            for key, b in buffers.items():
                b.copy_(saved[key])
    return flags


def _carries_grad(layer: fx.GraphModule, node: fx.Node, flag: dict[fx.Node, bool]) -> bool:
    """Static guess: whether ``node``'s value can carry a gradient."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
        return False
    if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    if node.op == "get_attr":
        obj = operator.attrgetter(node.target)(layer)
        return isinstance(obj, torch.Tensor) and obj.requires_grad
    if node.op == "call_module" and any(
            p.requires_grad for p in layer.get_submodule(node.target).parameters()):
        return True
    return any(flag.get(arg, False) for arg in node.all_input_nodes)


def _trace(layer: nn.Module, k: int, makers: list[int] | None, flags: list[bool] | None
           ) -> tuple[list[int], list[bool], list[int], tuple[list[int], list[bool]] | None]:
    """Follow the frontier through layer ``k``.

    Returns the makers and grad flags of the slots entering the layer (resolved when the
    previous layer was opaque), the slots the layer reads, and the makers and grad flags of
    its output slots; an opaque layer reads every slot and makes every output.
    """
    holders = [n for n in layer.graph.nodes if n.op == "placeholder"] \
        if isinstance(layer, fx.GraphModule) else []
    if len(holders) != 1:  # not a chain GraphModule: opaque
        if makers is None:
            makers, flags = [k - 1], [k > 0]
        return makers, flags, list(range(len(makers))), None
    x = holders[0]
    items = {u.args[1]: u for u in x.users
             if u.target is operator.getitem and isinstance(u.args[1], int)}
    tupled = bool(items) and len(items) == len(x.users)
    if makers is None:
        arity = max(items) + 1 if tupled else 1
        makers, flags = [k - 1] * arity, [k > 0] * arity
    slot_of = {x: 0} if len(makers) == 1 else {u: j for j, u in items.items() if tupled}
    output = next(n for n in layer.graph.nodes if n.op == "output")
    if len(makers) > 1 and not tupled:
        read = list(range(len(makers)))  # the tuple is used whole: assume every slot is read
    else:
        read = sorted(j for node, j in slot_of.items() if any(
            u is not output and u.target not in _SHAPE_OPS for u in node.users))
    flag: dict[fx.Node, bool] = {}
    for node in layer.graph.nodes:
        if node in slot_of:
            flag[node] = flags[slot_of[node]]
        elif node.op == "placeholder":
            flag[node] = any(flags)
        else:
            flag[node] = _carries_grad(layer, node, flag)
    out_makers, out_flags = [], []
    for value in _flat(output.args[0]):
        if value in slot_of:  # passed on: keeps its maker
            out_makers.append(makers[slot_of[value]])
            out_flags.append(flags[slot_of[value]])
        else:
            out_makers.append(k)
            out_flags.append(flag.get(value, False) if isinstance(value, fx.Node) else False)
    return makers, flags, read, (out_makers, out_flags)


def layer_edges(layers: Sequence[nn.Module], example_input: Any = None, *,
                include_constants: bool = False) -> list[tuple[int, int]]:
    """Which layer uses values made by which, for a chain of layers.

    Args:
        layers: the chain from ``layers_from_export`` (frontier-traced) or
            ``layers_from_sequential`` / a plain list (opaque: edges ``(i, i+1)``).
        example_input: input of layer 0; when given, the chain runs once (buffers and the
            CPU random state restored) and each value's gradient flag is measured instead
            of guessed from the graph.
        include_constants: keep edges carrying values without gradient (masks, position
            ids) and edges from model inputs (producer ``INPUT``) to layers after layer 0.

    Returns:
        Sorted unique ``(producer, consumer)`` pairs.

    Raises:
        ValueError: ``layers`` is empty, or a layer's output count disagrees with the
            measured run.
    """
    if not layers:
        raise ValueError("layer_edges: no layers")
    measured = _measured_flags(layers, example_input) if example_input is not None else None
    makers: list[int] | None = [INPUT] * len(measured[0]) if measured else None
    flags: list[bool] | None = measured[0] if measured else None
    edges: set[tuple[int, int]] = set()
    for k, layer in enumerate(layers):
        makers, flags, read, out = _trace(layer, k, makers, flags)
        for j in read:
            if (include_constants or flags[j]) and (makers[j] >= 0 or k > 0):
                edges.add((makers[j], k))
        makers, flags = out if out is not None else (None, None)
        if measured:
            if makers is None:
                makers = [k] * len(measured[k + 1])
            elif len(makers) != len(measured[k + 1]):
                raise ValueError(f"layer {k}: graph has {len(makers)} outputs, run gave "
                                 f"{len(measured[k + 1])}")
            flags = measured[k + 1]
    return sorted(edges)


def model_clusters(layers: Sequence[nn.Module], example_input: Any = None, *,
                   keep_fork: bool = False, include_constants: bool = False
                   ) -> list[list[int]]:
    """Clusters of a layer chain: ``clusters_from_layer_graph`` over ``layer_edges``.

    Args:
        layers: the chain, as for ``layer_edges``.
        example_input: optional input of layer 0, as for ``layer_edges``.
        keep_fork: as for ``clusters_from_layer_graph``.
        include_constants: as for ``layer_edges``.

    Returns:
        Lists of consecutive layer indices covering ``0 .. len(layers) - 1``.

    Raises:
        ValueError: as ``layer_edges``.
    """
    edges = layer_edges(layers, example_input, include_constants=include_constants)
    return clusters_from_layer_graph(len(layers), edges, keep_fork=keep_fork)
