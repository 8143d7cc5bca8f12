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
  to the parameters, once per group of parameters hanging from the same boundary nodes
  (so only the weight side runs), and adds the results to ``.grad``. Within a group, a
  boundary node below another gets its kept gradient back from a pre-hook instead of the
  sum (its share from the node above was already in it), so nothing counts twice.

Segments whose inputs need no gradient (token ids) do all their work in W; segments
without parameters do all of it in B. Saved tensors of swapped or recomputed layers live
until W, because the retained graph holds them.

Linear layers run under :func:`~trainwright.pipeline.deferred_linear.defer_linears` skip
this: their nodes stash what W needs in a
:class:`~trainwright.pipeline.deferred_linear.WeightStash`, and B asks autograd for their
weights too, so every such node runs in B even where its input does not hang from the
segment's inputs (the answer is None but for other uses of the weight, which count). When
the other parameters are small (a GPT block's layer norms), B computes their gradients as
well and frees the graph; otherwise they keep the boundary-node W above.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

from trainwright.pipeline.deferred_linear import WeightStash

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs: per group of parameters, where their gradients start."""

    params: list[torch.Tensor]
    groups: list = field(default_factory=list)
    """``(edges, grads, params, clamps)`` per group: ``GradientEdge`` roots, the gradient
    entering each, the parameters reached from them, and ``(node, kept grad_outputs)``
    pre-hooks for boundary nodes (only when the group has several)."""
    stash: WeightStash | None = None
    """Deferred linear layers whose weight gradients W adds from what B stashed."""


_DIRECT_SHARE = 0.1
"""B computes the other parameters' gradients itself when they hold at most this share of
the deferred weights' elements (freeing the graph); above it they keep a boundary-node W."""


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


@torch.no_grad()
def _accumulate(params: list, grads, shared=()) -> None:
    """Add ``grads`` into the parameters' ``.grad``.

    A first gradient is taken as it is, like autograd's accumulator does, unless a later
    in-place add could not or must not write into it: an expanded view (``p.sum()``'s), or
    a view of another tensor, or a tensor that is also a gradient handed in or out
    (``shared``: ``x + p`` gives ``x`` and ``p`` the same one) or another parameter's.
    Those are copied."""
    taken = {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            ptr = g.untyped_storage().data_ptr()
            dense = g.is_contiguous() or (g.dim() == 2 and g.t().is_contiguous())
            steal = dense and ptr not in taken
            p.grad = g if steal else g.clone(memory_format=torch.contiguous_format)
            taken.add(ptr)
        else:
            p.grad += g


def backward_input(outputs: tuple, grads: tuple | None, inputs: tuple,
                   params: list[torch.Tensor], stash: WeightStash | None = None,
                   ) -> tuple[tuple, WeightWork]:
    """B: gradients of ``inputs`` (set as their ``.grad`` too), and the work left for W.

    Args:
        outputs: the segment's outputs (the loss on the last layer).
        grads: gradients of ``outputs`` (None entries: no gradient; None: start from the loss).
        inputs: the segment's detached inputs.
        params: the segment's parameters.
        stash: the segment's deferred linear layers, if it ran under ``defer_linears``.
    """
    params = [p for p in params if p.requires_grad]
    outs, gs = _pairs(outputs, grads)
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    work = WeightWork(params)
    if not outs:
        return tuple(None for _ in inputs), work
    if not want:  # nothing to send back: all of it is weight work
        edges = [GradientEdge(_node(o), o.output_nr) for o in outs]
        work.groups = [(edges, gs, params, [])]
        return tuple(None for _ in inputs), work
    force: list[torch.Tensor] = []
    if stash is not None and stash.weights:
        work.stash, stash.defer = stash, True
        force = list(stash.weights.values())
        params = [p for p in params if id(p) not in stash.weights]
        if sum(p.numel() for p in params) <= _DIRECT_SHARE * sum(p.numel() for p in force):
            extra = params + force
            got = torch.autograd.grad(outs, want + extra, gs, allow_unused=True)
            _accumulate(extra, got[len(want):], shared=[*got[:len(want)], *gs])
            return _input_grads(inputs, got), work
    groups, roots_only = _groups(outs, want + force, params)
    nodes = list({n: None for g_nodes, _ in groups for n in g_nodes})
    kept: dict = {}
    handles = [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n in nodes]
    try:
        got = torch.autograd.grad(outs, want + force, gs, retain_graph=bool(params),
                                  allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    _accumulate(force, got[len(want):], shared=[*got[:len(want)], *gs])
    for g_nodes, g_params in groups:
        edges, grads = [], []
        for node in g_nodes:
            for i, g in enumerate(kept.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        clamps = [(n, kept[n]) for n in g_nodes if n in kept] if len(g_nodes) > 1 else []
        work.groups.append((edges, grads, g_params, clamps))
    for o, g in zip(outs, gs, strict=True):
        if _node(o) in roots_only:
            work.groups.append(([GradientEdge(_node(o), o.output_nr)], [g],
                                roots_only[_node(o)], []))
    return _input_grads(inputs, got), work


def _input_grads(inputs: tuple, got: tuple) -> tuple:
    """``got`` (gradients of the inputs needing one, first) aligned with ``inputs``, and set
    as their ``.grad``."""
    it = iter(got)
    result = tuple(next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None
                   for t in inputs)
    for t, g in zip(inputs, result, strict=True):
        if g is not None:
            t.grad = g
    return result


def _groups(outs: list, want: list, params: list) -> tuple[list, dict]:
    """Parameters grouped by the boundary nodes they hang from, and root nodes that lead to
    parameters only (root -> those parameters).

    One W call per group asks for that group's parameters only, so autograd runs just the
    weight side below its boundary nodes; one call for all would also re-run the input side
    between a higher layer's boundary and a lower layer's parameters."""
    roots = list({_node(o): None for o in outs})
    parents = _parents(roots)
    input_side, _ = _closure([_node(t) for t in want], parents)
    by_nodes: dict[frozenset, list] = {}
    roots_only: dict = {}
    for p in params:
        reached, touched = _closure([_node(p)], parents, stop=input_side)
        if touched:
            by_nodes.setdefault(frozenset(touched), []).append(p)
        for r in roots:
            if r in reached and r not in input_side:
                roots_only.setdefault(r, []).append(p)
    return [(list(k), v) for k, v in by_nodes.items()], roots_only


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameters' gradients from what :func:`backward_input` left."""
    if work.stash is not None:
        work.stash.flush()
        work.stash = None
    for edges, grads, params, clamps in work.groups:
        if not edges or not params:
            continue
        handles = [n.register_prehook(lambda _g, k=k: k) for n, k in clamps]
        try:
            got = torch.autograd.grad(edges, params, grads, allow_unused=True,
                                      retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        _accumulate(params, got, shared=grads)
    work.groups = []
