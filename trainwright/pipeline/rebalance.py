"""Live layer migration: the runtime side of a re-partition.

:class:`Migration` executes the ``MIG_*`` actions that
:func:`~trainwright.schedule.migration.migration_schedule` put into one step's action
lists. Per move, giver and receiver exchange, on the pipeline's control group:

1. ``prepare`` (giver, start of step): the layers' indices and parameter shapes. The
   receiver builds them from its own description of the model (every rank knows every
   layer's structure; parameters live only where the layer is placed) and answers ``ready``.
2. ``package`` (giver, after its forward ``F(k)``, once ``ready`` arrived): parameters and
   buffers, plus for every *shipped* micro-batch each moving layer's stored input and RNG
   state. The receiver installs the layers for forwards ``k+1..`` and holds the shipped
   inputs as recompute segments, so it back-propagates those micro-batches itself.
3. ``final`` (giver, after its last backward of the layers, just before ``SYNC``): gradients
   accumulated on the giver and optimizer state. The receiver adds the gradients; the giver
   deletes the layers.

Parameters do not change inside a step (the optimizer runs at ``STEP``), so sending them
early is exact; the receiver's result equals a run in which the layers had always been
there, up to floating-point summation order of the gradient.
"""

from __future__ import annotations

import copy
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trainwright.dist.comm import P2P
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import Segment
from trainwright.schedule.migration import MigrationSchedule, Move

__all__ = ["Migration", "MigrationStats", "pack_tree", "unpack_tree", "LayerCatalog"]

log = logging.getLogger(__name__)

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


class LayerCatalog:
    """Every layer of the model by index: real modules where placed, meta copies elsewhere.

    A receiver builds a migrating layer from its meta copy (``to_empty`` on its device,
    then the giver's parameters), which is how "the layer's structure" is known everywhere
    without holding every layer's weights.
    """

    def __init__(self, named: list[tuple[str, nn.Module]]):
        self.names = [n for n, _ in named]
        self.meta = [copy.deepcopy(m).to("meta") for _, m in named]

    def build(self, index: int, device: torch.device) -> nn.Module:
        """An empty (uninitialised) module of layer ``index`` on ``device``."""
        return copy.deepcopy(self.meta[index]).to_empty(device=device)

    def shapes(self, index: int) -> list[int]:
        """Flattened ``[numel, ...]`` of the layer's state, to check both sides agree."""
        return [t.numel() for t in self.meta[index].state_dict().values()]


@dataclass
class MigrationStats:
    """What one stage did in one migration step (giver side carries bytes and time)."""

    moves: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    shipped_microbatches: int = 0
    in_flight: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """Plain dict for metrics."""
        return dict(moves=self.moves, bytes_sent=self.bytes_sent,
                    bytes_received=self.bytes_received,
                    shipped_microbatches=self.shipped_microbatches, in_flight=self.in_flight,
                    seconds=self.seconds)


def _nbytes(packed: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in packed)


class Migration:
    """Executes one step's ``MIG_*`` actions for this stage.

    Args:
        plan: the step's migration schedule.
        stage_index: this rank's stage.
        stage: the stage whose layers change.
        ctrl: P2P on the control group.
        rank_of: ``stage -> global rank`` in this replica.
        catalog: structure of every layer.
        make_optimizer: ``params -> optimizer`` (the run's configured optimizer).
        device: where layers live.
    """

    def __init__(self, plan: MigrationSchedule, stage_index: int, stage: Stage, ctrl: P2P,
                 rank_of: Callable[[int], int], catalog: LayerCatalog,
                 make_optimizer: Callable[[list], torch.optim.Optimizer | None],
                 device: torch.device):
        self.plan, self.s, self.stage, self.ctrl = plan, stage_index, stage, ctrl
        self.rank_of, self.catalog, self.make_optimizer = rank_of, catalog, make_optimizer
        self.device = device
        self.stats = MigrationStats(moves=[m.to_dict() for m in plan.moves])
        self._built: dict[int, list[nn.Module]] = {}
        self._t0: float | None = None
        for mv in plan.moves:  # the giver records RNG state of layers that may be shipped
            if mv.giver == stage_index:
                stage.record_rng |= set(mv.layers)

    def run(self, action) -> None:
        """Execute one ``MIG_*`` action."""
        mv = self.plan.moves[action.mb]
        getattr(self, "_" + action.kind.lower())(action.mb, mv)

    # giver -------------------------------------------------------------------------------
    def _mig_prepare(self, i: int, mv: Move) -> None:
        self._t0 = self._t0 or time.perf_counter()
        desc = [len(mv.layers), *mv.layers]
        for index in mv.layers:
            shapes = self.catalog.shapes(index)
            desc += [len(shapes), *shapes]
        self.ctrl.send(self.rank_of(mv.receiver), "mig_prepare", i,
                       [torch.tensor(desc, dtype=torch.int64)])

    def _mig_send(self, i: int, mv: Move) -> None:
        self.ctrl.recv(self.rank_of(mv.receiver), "mig_ready", i)
        shipped = {}
        for j in self.plan.shipped[i]:
            segs = []
            for index in mv.layers:
                seg = self.stage.store.pop(index, j)
                segs.append((seg.inputs, seg.rng_state))
            shipped[j] = segs
        self.stats.in_flight = max(self.stats.in_flight,
                                   len({m for _, m in self.stage.store.held()} | set(shipped)))
        params = {index: self.stage.layer(index).module.state_dict() for index in mv.layers}
        packed = pack_tree({"params": params, "shipped": shipped}, self.device)
        self.ctrl.send(self.rank_of(mv.receiver), "mig_package", i, packed)
        self.stats.bytes_sent += _nbytes(packed)
        self.stats.shipped_microbatches += len(shipped)
        self.stage.retire_layers(mv.layers)

    def _mig_finish(self, i: int, mv: Move) -> None:
        final = {}
        for slot in self.stage.drop_retired(mv.layers):
            grads = [p.grad for p in slot.module.parameters()]
            opt = slot.optimizer.state_dict() if slot.optimizer is not None else None
            final[slot.index] = {"grads": grads, "optim": opt}
        packed = pack_tree(final, self.device)
        self.ctrl.send(self.rank_of(mv.receiver), "mig_final", i, packed)
        self.stats.bytes_sent += _nbytes(packed)
        self.stage.record_rng -= set(mv.layers)
        self.stats.seconds = time.perf_counter() - (self._t0 or time.perf_counter())

    # receiver ----------------------------------------------------------------------------
    def _mig_accept(self, i: int, mv: Move) -> None:
        self._t0 = self._t0 or time.perf_counter()
        (desc,) = self.ctrl.recv(self.rank_of(mv.giver), "mig_prepare", i)
        expect = [len(mv.layers), *mv.layers]
        for index in mv.layers:
            shapes = self.catalog.shapes(index)
            expect += [len(shapes), *shapes]
        if desc.tolist() != expect:
            raise RuntimeError(f"stage {self.s}: migration of layers {list(mv.layers)} from stage "
                               f"{mv.giver} announced a different structure ({desc.tolist()} vs "
                               f"{expect}); the ranks disagree about the model")
        self._built[i] = [self.catalog.build(index, self.device) for index in mv.layers]
        self.ctrl.send(self.rank_of(mv.giver), "mig_ready", i, [torch.ones(1)])

    def _mig_recv(self, i: int, mv: Move) -> None:
        packed = self.ctrl.recv(self.rank_of(mv.giver), "mig_package", i)
        self.stats.bytes_received += _nbytes(packed)
        pkg = unpack_tree(packed, self.device)
        slots = []
        for index, module in zip(mv.layers, self._built.pop(i), strict=True):
            module.load_state_dict(pkg["params"][index])
            slots.append(LayerSlot(index, self.catalog.names[index], module,
                                   self.make_optimizer(list(module.parameters()))))
        self.stage.add_layers(slots)
        for j, segs in pkg["shipped"].items():
            for index, (inputs, rng) in zip(mv.layers, segs, strict=True):
                rng = (rng[0].cpu(), [r.cpu() for r in rng[1]]) if rng is not None else None
                inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                               if isinstance(t, torch.Tensor) else t for t in inputs)
                self.stage.store.put(Segment(index, j, inputs, None, policy="recompute",
                                             rng_state=rng))

    def _mig_adopt(self, i: int, mv: Move) -> None:
        packed = self.ctrl.recv(self.rank_of(mv.giver), "mig_final", i)
        self.stats.bytes_received += _nbytes(packed)
        final = unpack_tree(packed, self.device)
        for index in mv.layers:
            slot = self.stage.layer(index)
            for p, g in zip(slot.module.parameters(), final[index]["grads"], strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
            if slot.optimizer is not None and final[index]["optim"] is not None:
                slot.optimizer.load_state_dict(final[index]["optim"])
        self.stats.seconds = time.perf_counter() - (self._t0 or time.perf_counter())
