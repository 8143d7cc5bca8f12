"""Turn a model into an ordered list of layers for the pipeline runtime.

A *layer* is an ``nn.Module`` whose forward takes one argument (a tensor or a tuple of
tensors) and returns a tensor or a tuple of tensors; the runtime feeds layer k's output to
layer k+1. ``nn.Sequential`` models already are such a chain. Other models are captured
with ``torch.export.export(..., strict=False)`` (works on Hugging Face GPT-2 / Llama where
``torch.fx.symbolic_trace`` fails) and cut into one ``fx.GraphModule`` per group of nodes.

Grouping rule (``layers_from_export``). Each node's innermost module path (from
``meta["nn_module_stack"]``) is walked down from the root. The root is always opened (so
an ``nn.Sequential`` model gives one group per child); a container (``ModuleList``,
``ModuleDict``) is opened and each of its items is a group (``blocks.0``); any other
module, ``nn.Sequential`` included, is a group (``group_by="top"``), or, with
``group_by="blocks"``, is opened too when a container lies somewhere below it (so Hugging
Face ``transformer.h.0`` becomes its own group). A node that belongs to an opened module
only (a residual ``add`` at top level, input processing, a mask built in
``GPT2Model.forward``) is *glue*: it joins the group of the previous node in execution
order, or the first group when nothing precedes it. A ``getitem`` follows its
multi-output source. Groups are maximal runs of equal keys, so a module called twice
(a shared activation) gives two layers, the second named ``act#1``.

Frontier. The value passed from layer k to k+1 is the tuple of every value produced at or
before layer k (model inputs included) and consumed after it, in execution order, so long
skips and residuals travel along; a one-value frontier is passed as a bare tensor. The
last layer returns the model's flat user outputs (a bare tensor when there is one).
Symbolic sizes (``dynamic_batch=True``) never cross a boundary: each layer re-reads them
from the shapes of its input tensors.

Parameters and buffers are *shared*, not copied: each layer registers the original
``nn.Parameter`` / buffer objects under their original dotted names (``blocks.0.qkv.weight``),
so the layers and the model see the same values, gradients and optimizer updates; a weight
used in two layers (tied embeddings) is the same object in both. Train/eval mode is fixed
at export time (dropout, batch norm); in train mode batch norm updates the shared running
statistics in place, as the model would.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from trainwright.errors import PlanError

__all__ = ["layers_from_sequential", "layers_from_export", "boundary_bytes"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: always opened
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_GROUP_BY = ("top", "blocks")
_PRESERVED = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY",
                     "_user_preserved_attributes")


def layers_from_sequential(model: nn.Sequential | list[nn.Module]) -> list[nn.Module]:
    """Return the children of a sequential model in order (the modules themselves).

    Args:
        model: an ``nn.Sequential`` or a list of modules run one after another.

    Returns:
        The layers in execution order.

    Raises:
        ValueError: the model has no layers.
        TypeError: an element is not an ``nn.Module``.
    """
    layers = list(model)
    if not layers:
        raise ValueError("layers_from_sequential: the model is empty; give at least one module")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers_from_sequential: element {i} is a {type(layer).__name__}, "
                            "not an nn.Module")
    return layers


def _copy_into(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Apply a functionalised buffer mutation (called from generated layer code)."""
    with torch.no_grad():
        buffer.copy_(value)


def _module_path(node: fx.Node) -> str:
    """Path of the innermost module a node was recorded in (``""``: the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _group_key(model: nn.Module, path: str, group_by: str) -> str | None:
    """The group of a node recorded in module ``path``, or ``None`` for glue."""
    parts = path.split(".") if path else []
    module = model
    for i, part in enumerate(parts):
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            return None  # the path leaves the model's tree: treat the node as glue
        opened = isinstance(child, _CONTAINERS) or (
            group_by == "blocks" and not isinstance(module, _CONTAINERS)
            and any(isinstance(m, _CONTAINERS) for m in child.modules()))
        if not opened:
            return ".".join(parts[: i + 1])
        module = child
    return None


def _is_symbolic(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), _SYMBOLIC)


def _build_layer(name: str, members: list[fx.Node], inputs: list[fx.Node],
                 outputs: list[Any], attrs: dict[fx.Node, tuple[str, Any]],
                 mutations: list[tuple[Any, fx.Node]]) -> fx.GraphModule:
    """One ``GraphModule`` running ``members``: frontier ``inputs`` in, ``outputs`` out."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {}
    if len(inputs) == 1:
        env[inputs[0]] = x
    for i, value in enumerate(inputs if len(inputs) != 1 else []):
        env[value] = graph.call_function(operator.getitem, (x, i))
    root: dict[str, Any] = {}

    def symbolic(node: fx.Node) -> fx.Node:
        expr = node.meta["val"].node.expr
        if expr.is_symbol:  # a size: read it off a tensor this layer already has
            for orig, new in env.items():
                val = orig.meta.get("val")
                for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        return graph.call_function(torch.ops.aten.sym_size.int, (new, dim))
        return graph.node_copy(node, lookup)  # an expression of sizes: recompute it

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node in attrs:
                target, obj = attrs[node]
                root[target] = obj
                env[node] = graph.get_attr(target)
            elif _is_symbolic(node):
                env[node] = symbolic(node)
            else:
                raise PlanError(f"layer {name!r} needs {node.name!r} from an earlier layer, but "
                                f"only tensors cross the cuts between layers (a Python number "
                                f"such as x.item() cannot); compute it inside the layer that "
                                f"uses it (wrap the submodules that share it in one nn.Module)")
        return env[node]

    for node in members:
        env[node] = graph.node_copy(node, lookup)
    for value, buffer in mutations:
        graph.call_function(_copy_into, (lookup(buffer), fx.map_arg(value, lookup)))
    out = [fx.map_arg(v, lookup) for v in outputs]
    graph.output(out[0] if len(out) == 1 else tuple(out))
    layer = fx.GraphModule(root, graph, class_name="ExportedLayer")
    layer.name = name
    layer.meta[_PRESERVED] = {"name": name}  # so that copy.deepcopy keeps it
    return layer


def layers_from_export(model: nn.Module, example_args: tuple, *, group_by: str = "top",
                       dynamic_batch: bool = False) -> list[nn.Module]:
    """Capture ``model`` with ``torch.export`` and cut it into chain layers, one per group.

    Args:
        model: the model; its train/eval mode at this call is baked into the layers.
        example_args: positional tensor arguments of one forward call (a bare tensor is
            taken as a 1-tuple). Layer 0 takes ``example_args[0]`` alone when there is one
            argument, else the tuple.
        group_by: ``"top"`` (top-level children; container items) or ``"blocks"`` (also
            open modules that hold a container, e.g. Hugging Face ``transformer``). See the
            module docstring for the full rule.
        dynamic_batch: export dimension 0 of every input as dynamic, so the layers accept
            other batch sizes; the example batch must then be at least 2.

    Returns:
        ``fx.GraphModule`` layers in execution order, each with a ``name`` attribute and the
        model's own parameters and buffers registered under their original names.

    Raises:
        ValueError: unknown ``group_by``.
        TypeError: an example argument is not a tensor.
        PlanError: the model cannot be cut into layers: it mutates an input in place, has
            side-effect tokens, or passes a non-tensor value between groups (the message
            says which and how to change the model).
    """
    if group_by not in _GROUP_BY:
        raise ValueError(f"group_by must be one of {_GROUP_BY}, not {group_by!r}")
    ep = _export(model, example_args, dynamic_batch)
    graph = ep.graph_module.graph
    inputs, attrs = _split_inputs(model, ep)
    user_outputs, mutations = _split_outputs(ep, attrs)
    names, members, group_of = _group_nodes(model, graph, inputs, group_by)
    frontiers = _frontiers(graph, inputs, user_outputs, names, group_of)
    layer_mutations: list[list[tuple[Any, fx.Node]]] = [[] for _ in members]
    for value, buffer in mutations:
        layer_mutations[max(group_of.get(value, 0), 0)].append((value, buffer))
    return [_build_layer(names[k], members[k], frontiers[k], frontiers[k + 1], attrs,
                         layer_mutations[k]) for k in range(len(members))]


def _export(model: nn.Module, example_args: tuple,
            dynamic_batch: bool) -> torch.export.ExportedProgram:
    """Check the example arguments and capture ``model`` (non-strict ``torch.export``)."""
    args = (example_args,) if isinstance(example_args, torch.Tensor) else tuple(example_args)
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"example_args[{i}] is a {type(arg).__name__}; only tensors are "
                            "supported")
    dynamic = None
    if dynamic_batch:
        batch = getattr(torch.export.Dim, "DYNAMIC", None) or torch.export.Dim("batch")
        dynamic = tuple({0: batch} if a.dim() else None for a in args)
    return torch.export.export(model, args, dynamic_shapes=dynamic, strict=False)


def _split_inputs(model: nn.Module, ep: torch.export.ExportedProgram
                  ) -> tuple[list[fx.Node], dict[fx.Node, tuple[str, Any]]]:
    """The user-input placeholders, and node -> ``(name, object)`` of every parameter,
    buffer, constant and ``get_attr`` the graph reads (the model's own objects)."""
    graph = ep.graph_module.graph
    attrs: dict[fx.Node, tuple[str, Any]] = {}
    inputs: list[fx.Node] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True):
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(node)
        elif spec.kind == InputKind.PARAMETER:
            attrs[node] = (spec.target, model.get_parameter(spec.target))
        elif spec.kind == InputKind.BUFFER:
            attrs[node] = (spec.target, model.get_buffer(spec.target))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            attrs[node] = (spec.target, ep.constants[spec.target])
        else:
            raise PlanError(f"the exported model has an input of kind {spec.kind.name} (a side "
                            f"effect such as a print or an effectful custom op), which cannot "
                            f"be cut into layers; remove it from forward, or return an "
                            f"nn.Sequential / a list of layers instead")
    for node in graph.nodes:
        if node.op == "get_attr":  # e.g. the subgraph of a `with torch.no_grad():` region
            attrs[node] = (node.target, operator.attrgetter(node.target)(ep.graph_module))
    return inputs, attrs


def _split_outputs(ep: torch.export.ExportedProgram, attrs: dict[fx.Node, tuple[str, Any]]
                   ) -> tuple[list[Any], list[tuple[Any, fx.Node]]]:
    """The user outputs, and ``(new value, buffer node)`` of every buffer mutation."""
    user_outputs: list[Any] = []
    mutations: list[tuple[Any, fx.Node]] = []
    buffer_node = {target: n for n, (target, _) in attrs.items()}
    output = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    for value, spec in zip(output.args[0], ep.graph_signature.output_specs, strict=True):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append((value, buffer_node[spec.target]))
        else:
            raise PlanError(f"the exported model has an output of kind {spec.kind.name} (an "
                            f"in-place update of an input, e.g. x.add_(1)), which cannot be cut "
                            f"into layers; use out-of-place ops (x = x + 1), or return an "
                            f"nn.Sequential / a list of layers instead")
    return user_outputs, mutations


def _group_nodes(model: nn.Module, graph: fx.Graph, inputs: list[fx.Node], group_by: str
                 ) -> tuple[list[str], list[list[fx.Node]], dict[fx.Node, int]]:
    """Group the compute nodes: maximal runs of one key; glue joins the previous group.

    Returns:
        Each group's name, its nodes in execution order, and node -> group (``-1``: a
        model input).
    """
    group_of: dict[fx.Node, int] = {n: -1 for n in inputs}
    names: list[str] = []
    members: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    seen: dict[str, int] = {}
    current: str | None = None
    key_of: dict[str, str | None] = {}
    compute = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    for node in compute:
        source = node.args[0] if node.target is operator.getitem else None
        path = _module_path(node)
        if path not in key_of:
            key_of[path] = _group_key(model, path, group_by)
        key = key_of[path]
        if isinstance(source, fx.Node) and group_of.get(source, -1) >= 0:
            group = group_of[source]
        elif key is None or key == current:
            if not members:
                pending.append(node)
                continue
            group = len(members) - 1
        else:
            count = seen[key] = seen.get(key, -1) + 1
            names.append(key if count == 0 else f"{key}#{count}")
            group_of.update({n: len(members) for n in pending})
            members.append(pending)
            pending, current, group = [], key, len(members) - 1
        members[group].append(node)
        group_of[node] = group
    if pending or not members:
        names.append("model")
        members.append(pending)
        group_of.update({n: len(members) - 1 for n in pending})
    return names, members, group_of


def _frontiers(graph: fx.Graph, inputs: list[fx.Node], user_outputs: list[Any],
               names: list[str], group_of: dict[fx.Node, int]) -> list[list[Any]]:
    """What enters each layer, then the model's outputs: entry k is layer k's input.

    Raises:
        PlanError: a non-tensor value would cross a cut.
    """
    n_layers = len(names)
    last_use = {v: max((group_of[u] for u in v.users if u in group_of), default=-1)
                for v in group_of}
    for value in user_outputs:
        if isinstance(value, fx.Node) and value in last_use:
            last_use[value] = n_layers
    values = [v for v in graph.nodes if v in group_of and not _is_symbolic(v)]
    frontiers = [inputs]
    for k in range(n_layers - 1):
        frontier = [v for v in values if group_of[v] <= k < last_use[v]]
        for v in frontier:
            if not isinstance(v.meta.get("val"), torch.Tensor):
                raise PlanError(f"value {v.name!r} ({type(v.meta.get('val')).__name__}) would "
                                f"cross the boundary after layer {names[k]!r}, but layers pass "
                                f"only tensors; compute it inside the layer that uses it (wrap "
                                f"the submodules that share it in one nn.Module)")
        frontiers.append(frontier)
    frontiers.append(user_outputs)
    return frontiers


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def boundary_bytes(layers: Sequence[nn.Module], example_input: Any) -> list[int]:
    """Bytes that cross each cut of the chain, measured by running it once.

    Buffers (e.g. batch-norm running statistics) are restored afterwards, so the run has
    no side effect on the layers.

    Args:
        layers: the chain, as returned by ``layers_from_sequential`` / ``layers_from_export``.
        example_input: input of layer 0 (a tensor, or a tuple of tensors).

    Returns:
        ``len(layers) - 1`` sizes: entry k is the summed ``numel * element_size`` of the
        tensors layer k passes to layer k+1.

    Raises:
        ValueError: ``layers`` is empty.
    """
    if not layers:
        raise ValueError("boundary_bytes: no layers")
    buffers = {id(b): b for layer in layers for b in layer.buffers()}
    saved = {key: b.detach().clone() for key, b in buffers.items()}
    sizes: list[int] = []
    value = example_input
    try:
        with torch.no_grad():
            for k, layer in enumerate(layers):
                value = layer(value)
                if k < len(layers) - 1:
                    sizes.append(_nbytes(value))
    finally:
        with torch.no_grad():
            for key, b in buffers.items():
                b.copy_(saved[key])
    return sizes
