"""A layer segment's backward in two passes: B (input gradients now) and W (weight gradients later).

Zero-bubble schedules send the input gradient to the previous stage as soon as it exists
and compute the weight gradient when the stage would otherwise idle. One autograd graph
serves both passes:

* **B** walks the graph from the segment's outputs to its inputs only
  (``torch.autograd.grad(..., inputs=the inputs, retain_graph=True)``). Before it runs,
  pre-hooks are set on the *boundary* nodes: nodes on a path to an input that also lead,
  through nodes on no such path, to a parameter. Each hook keeps the gradient arriving at
  its node. Then the outputs are dropped: only the boundary nodes and what lies below them
  (the weight side, with the tensors it saved) stay alive.
* **W** runs autograd from the boundary nodes (``GradientEdge``) with the kept gradients
  to the parameters only, and adds the results to ``.grad``. A boundary node below another
  boundary node gets its kept gradient back from a pre-hook instead of the sum (its share
  from the node above was already in it), so nothing counts twice.

Segments whose inputs need no gradient (token ids) do all their work in W; segments
without parameters do all of it in B. Saved tensors of swapped or recomputed layers live
until W, because the retained graph holds them.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs: the parameters and where their gradients start."""

    params: list[torch.Tensor]
    edges: list = field(default_factory=list)
    """``GradientEdge`` roots of W."""
    grads: list = field(default_factory=list)
    """The gradient entering each edge."""
    clamps: list = field(default_factory=list)
    """``(node, kept grad_outputs)`` of boundary nodes (more than one: pre-hooks in W)."""


def _node(t: torch.Tensor):
    """The graph node producing ``t`` (a leaf's gradient accumulator, created on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(roots: list) -> dict:
    """Node -> the nodes whose backward feeds it (reverse edges), over the graph below roots."""
    parents: dict = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _closure(starts: list, parents: dict, stop: set | None = None) -> tuple[set, set]:
    """Nodes reached from ``starts`` along reverse edges, and the ``stop`` nodes touched."""
    reached, touched = set(starts), set()
    queue = deque(starts)
    while queue:
        for up in parents.get(queue.popleft(), ()):
            if up in reached:
                continue
            if stop is not None and up in stop:
                touched.add(up)
                continue
            reached.add(up)
            queue.append(up)
    return reached, touched


def _pairs(outputs: tuple, grads: tuple | None) -> tuple[list, list]:
    outs, gs = [], []
    for i, o in enumerate(outputs):
        g = None if grads is None else grads[i]
        if isinstance(o, torch.Tensor) and o.requires_grad and (grads is None or g is not None):
            outs.append(o)
            gs.append(torch.ones_like(o) if g is None else g)
    return outs, gs


def backward_input(outputs: tuple, grads: tuple | None, inputs: tuple,
                   params: list[torch.Tensor]) -> tuple[tuple, WeightWork]:
    """B: gradients of ``inputs`` (set as their ``.grad`` too), and the work left for W.

    Args:
        outputs: the segment's outputs (the loss on the last layer).
        grads: gradients of ``outputs`` (None entries: no gradient; None: start from the loss).
        inputs: the segment's detached inputs.
        params: the segment's parameters.
    """
    params = [p for p in params if p.requires_grad]
    outs, gs = _pairs(outputs, grads)
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    work = WeightWork(params)
    if not outs:
        return tuple(None for _ in inputs), work
    if not want:  # nothing to send back: all of it is weight work
        work.edges = [GradientEdge(_node(o), o.output_nr) for o in outs]
        work.grads = gs
        return tuple(None for _ in inputs), work
    boundary, loose = _boundary(outs, want, params)
    kept: dict = {}
    handles = [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n in boundary]
    try:
        got = torch.autograd.grad(outs, want, gs, retain_graph=bool(params), allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for node in boundary:
        for i, g in enumerate(kept.get(node, ())):
            if g is not None:
                work.edges.append(GradientEdge(node, i))
                work.grads.append(g)
        if node in kept and len(boundary) > 1:
            work.clamps.append((node, kept[node]))
    for o, g in zip(outs, gs, strict=True):
        if _node(o) in loose:
            work.edges.append(GradientEdge(_node(o), o.output_nr))
            work.grads.append(g)
    it = iter(got)
    result = tuple(next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None
                   for t in inputs)
    for t, g in zip(inputs, result, strict=True):
        if g is not None:
            t.grad = g
    return result, work


def _boundary(outs: list, want: list, params: list) -> tuple[list, set]:
    """Boundary nodes between the input side and the weight side, and root nodes that
    lead to parameters only (their output gradient starts W directly)."""
    roots = list({_node(o): None for o in outs})
    parents = _parents(roots)
    input_side, _ = _closure([_node(t) for t in want], parents)
    boundary: dict = {}
    loose = set()
    for p in params:
        reached, touched = _closure([_node(p)], parents, stop=input_side)
        boundary.update(dict.fromkeys(touched))
        loose |= {r for r in roots if r in reached and r not in input_side}
    return list(boundary), loose


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameters' gradients from what :func:`backward_input` left."""
    if not work.params or not work.edges:
        return
    handles = [n.register_prehook(lambda _g, k=k: k) for n, k in work.clamps]
    try:
        got = torch.autograd.grad(work.edges, work.params, work.grads, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for p, g in zip(work.params, got, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g
    work.edges, work.grads, work.clamps = [], [], []
