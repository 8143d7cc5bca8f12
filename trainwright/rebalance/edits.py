"""Dynamic models: insert or remove layers between steps (architecture search).

The model changes on every rank at once: the hook named by ``rebalance.edits``
(``"module:function"``) is called before each step with the step number and returns a list
of :class:`InsertLayer` / :class:`RemoveLayer`. Every rank applies the same edits; the stage
that holds the neighbour takes a new layer (with a fresh optimizer), every rank renumbers
its layers, and the imbalance this creates is found and fixed by the rebalancer like any
other. Example (``mypkg/search.py``)::

    def edits(step):
        if step == 50:  # grow the model: a wider MLP after layer 2
            return [InsertLayer(at=3, build=lambda: Wide(256), name="wide")]
        return []

``build`` runs on every rank (the other ranks keep only the structure, on the meta device),
so it must build the same module everywhere: seed it, or let trainwright seed it
(``torch.manual_seed(train.seed + step)`` is set before each call).
Checkpoints of an edited model load only into the edited model: ``trainwright.load_model``
replays the hook on the factory's layers (:func:`edited_layers`); resume is not
supported across edits.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainwright.errors import ConfigError, PlanError
from trainwright.pipeline.stage import LayerSlot

__all__ = ["InsertLayer", "RemoveLayer", "load_edit_hook", "apply_edits", "edited_layers"]


@dataclass(frozen=True)
class InsertLayer:
    """Insert a layer so that it gets model index ``at`` (layers from ``at`` on shift by one).

    It joins the stage holding layer ``at - 1`` (stage 0 when ``at == 0``).
    """

    at: int
    build: Callable[[], nn.Module]
    name: str = "inserted"


@dataclass(frozen=True)
class RemoveLayer:
    """Remove the layer with model index ``index`` (later layers shift down by one)."""

    index: int


def load_edit_hook(spec: str) -> Callable[[int], list]:
    """Import ``"module:function"``."""
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"rebalance.edits = {spec!r} cannot be imported ({exc}); give "
                          f"\"module:function\" importable on every rank") from None


def _renumber(mapping: dict[int, int], stage) -> None:
    for slot in stage.slots:
        slot.index = mapping[slot.index]
    stage.profiler.renumber(mapping)
    store = stage.store
    store.policies = {mapping[k]: v for k, v in store.policies.items() if k in mapping}


def apply_edits(edits: list, *, stage, stage_index: int, counts: list[int], catalog,
                clusters: list[list[int]], make_optimizer, device: torch.device,
                seed: int) -> tuple[list[int], list[list[int]]]:
    """Apply ``edits`` on this rank, between steps.

    Args:
        edits: :class:`InsertLayer` / :class:`RemoveLayer`, applied in order.
        stage: this rank's stage (must hold no activations).
        stage_index: its index.
        counts: layers per stage before.
        catalog: the model's :class:`~trainwright.rebalance.catalog.LayerCatalog`.
        clusters: fork/join clusters before (may be empty on non-deciding stages).
        make_optimizer: ``params -> optimizer``.
        device: where this stage's layers live.
        seed: seeds each ``build`` call, so every rank builds the same layer.

    Returns:
        The partition and the clusters after the edits.
    """
    if stage.store.held():
        raise RuntimeError("model edits must happen between steps")
    counts, clusters = list(counts), [list(c) for c in clusters]
    for e in edits:
        n = sum(counts)
        if isinstance(e, InsertLayer):
            if not 0 < e.at < n:
                raise PlanError(f"InsertLayer(at={e.at}) must be between 1 and {n - 1}: the "
                                f"first and last layers stay where the data enters and the "
                                f"loss is computed")
            owner = _stage_of(counts, e.at - 1)
            torch.manual_seed(seed)
            module = e.build()
            _renumber({i: i + (i >= e.at) for i in range(n)}, stage)
            catalog.names.insert(e.at, e.name)
            catalog.meta.insert(e.at, copy.deepcopy(module).to("meta"))
            if owner == stage_index:
                module.to(device)
                stage.add_layers([LayerSlot(e.at, e.name, module,
                                            make_optimizer(list(module.parameters())))])
            counts[owner] += 1
            clusters = _insert_cluster(clusters, e.at)
        elif isinstance(e, RemoveLayer):
            if not 0 < e.index < n - 1:
                raise PlanError(f"RemoveLayer({e.index}): only layers 1 .. {n - 2} can go")
            owner = _stage_of(counts, e.index)
            if counts[owner] == 1:
                raise PlanError(f"RemoveLayer({e.index}) would empty stage {owner}; insert "
                                f"or move layers there first")
            if owner == stage_index:
                stage.slots = [s for s in stage.slots if s.index != e.index]
                stage.profiler.forget(e.index)
            _renumber({i: i - (i > e.index) for i in range(n) if i != e.index}, stage)
            del catalog.names[e.index], catalog.meta[e.index]
            counts[owner] -= 1
            clusters = [[i - (i > e.index) for i in c if i != e.index] for c in clusters]
            clusters = [c for c in clusters if c]
        else:
            raise TypeError(f"unknown model edit {e!r}; use InsertLayer or RemoveLayer")
    return counts, clusters


def _stage_of(counts: list[int], layer: int) -> int:
    acc = 0
    for s, c in enumerate(counts):
        acc += c
        if layer < acc:
            return s
    raise IndexError(layer)


def _insert_cluster(clusters: list[list[int]], at: int) -> list[list[int]]:
    """Shift indices; the new layer joins a cluster that spans the insertion point."""
    out = []
    for c in clusters:
        shifted = [i + (i >= at) for i in c]
        if at - 1 in c and at in c:  # inserted inside a fork/join region: stays inside
            shifted = sorted([*shifted, at])
        out.append(shifted)
    if not any(at in c for c in out):
        pos = next((k for k, c in enumerate(out) if c[0] > at), len(out))
        out.insert(pos, [at])
    return out


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
