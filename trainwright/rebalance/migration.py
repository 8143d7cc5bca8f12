"""Live layer migration: the runtime side of a re-partition.

:class:`Migration` executes the ``MIG_*`` actions that
:func:`~trainwright.rebalance.moves.migration_schedule` put into one step's action
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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from trainwright.dist.comm import P2P
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import Segment
from trainwright.rebalance.catalog import LayerCatalog
from trainwright.rebalance.moves import MigrationSchedule, Move
from trainwright.rebalance.pack import pack_tree, unpack_tree
from trainwright.schedule.actions import Action

__all__ = ["Migration", "MigrationStats"]

log = logging.getLogger(__name__)


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

    def run(self, action: Action) -> None:
        """Execute one ``MIG_*`` action (``action.mb`` is the move's index in the plan)."""
        handler = self.HANDLERS.get(action.kind)
        if handler is None:
            raise ValueError(f"stage {self.s}: {action} is not a migration action; the "
                             f"migration executor runs {sorted(self.HANDLERS)}")
        handler(self, action.mb, self.plan.moves[action.mb])

    # giver -------------------------------------------------------------------------------
    def _prepare(self, i: int, mv: Move) -> None:
        self._t0 = self._t0 or time.perf_counter()
        desc = [len(mv.layers), *mv.layers]
        for index in mv.layers:
            shapes = self.catalog.shapes(index)
            desc += [len(shapes), *shapes]
        self.ctrl.send(self.rank_of(mv.receiver), "mig_prepare", i,
                       [torch.tensor(desc, dtype=torch.int64)])

    def _send(self, i: int, mv: Move) -> None:
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

    def _finish(self, i: int, mv: Move) -> None:
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
    def _accept(self, i: int, mv: Move) -> None:
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

    def _recv(self, i: int, mv: Move) -> None:
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

    def _adopt(self, i: int, mv: Move) -> None:
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

    HANDLERS: ClassVar[dict[str, Callable[[Migration, int, Move], None]]] = {
        "MIG_PREPARE": _prepare, "MIG_SEND": _send, "MIG_FINISH": _finish,
        "MIG_ACCEPT": _accept, "MIG_RECV": _recv, "MIG_ADOPT": _adopt}
    """The dispatch table: action kind -> ``handler(self, move_index, move)``."""
