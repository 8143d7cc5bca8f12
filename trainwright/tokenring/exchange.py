"""The token ring as the trainer's gradient exchange.

:class:`RingExchange` is a :class:`~trainwright.sync.base.GradSync`: the trainer's one step
loop computes a node's gradient, ``SYNC`` offers it to the ring and waits for the step to
close, ``STEP`` applies every closed step (the summed gradient of its contributors, divided
by their count, goes into ``p.grad`` and each layer's optimizer steps). A node that finds a
step already closed skips its compute (:meth:`RingExchange.begin_step`); one that fell
behind applies several closed steps at once (:meth:`RingExchange.applied_through`).

Emulation for benchmarks (``tokenring.slow_node``, ``slow_probability``, ``slow_factor``,
``pace_s``) lives here too, since it acts around the exchange; a test's ``kill_*`` fault
strikes at :attr:`RingExchange.fault` (:mod:`trainwright.dist.faults`).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from collections.abc import Callable

import torch

from trainwright.config import TokenRingConfig
from trainwright.dist.faults import ring_fault
from trainwright.sync.base import GradSync, LayerOptimizers, WeightUpdate
from trainwright.tokenring.ring import TokenRing
from trainwright.tokenring.state import snapshot
from trainwright.tokenring.work import Unit, WorkQueue

__all__ = ["RingExchange", "RingUpdate", "param_hash", "transient_slow", "is_slow"]


def transient_slow(seed: int, step: int, node: int, probability: float) -> bool:
    """Whether ``node`` is a transient straggler in ``step``: an independent draw per
    (step, node) with ``probability``, the same in every process and system for one
    ``seed`` (benchmarks compare systems under the same pattern)."""
    return probability > 0 and random.Random(f"{seed}:{step}:{node}").random() < probability


def is_slow(cfg: TokenRingConfig, index: int, step: int) -> bool:
    """Whether node ``index`` emulates a slower machine in ``step``: the permanent
    ``slow_node``, or a transient straggler (``slow_probability``)."""
    if cfg.slow_factor <= 1:
        return False
    return index == cfg.slow_node or transient_slow(cfg.slow_seed, step, index,
                                                    cfg.slow_probability)


def param_hash(params: list[torch.Tensor]) -> str:
    """SHA-256 of the parameters' bytes (equal hashes = bit-identical replicas)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class RingExchange(GradSync):
    """A node's gradient exchange through a :class:`~trainwright.tokenring.ring.TokenRing`.

    Args:
        cfg: the ``[tokenring]`` section.
        index: this node's index.
        restarted: this process replaces a node killed by fault injection (it is not killed
            again).
        on_applied: called with ``(step, slots)`` after each applied step (the node
            writes checkpoints there).
    """

    def __init__(self, cfg: TokenRingConfig, index: int, restarted: bool = False,
                 on_applied: Callable[[int, list], None] | None = None):
        self.cfg, self.index, self.restarted = cfg, index, restarted
        self.fault = ring_fault(cfg, index, restarted)
        """Where a test's ``tokenring.kill_*`` fault strikes (None: nowhere)."""
        self.on_applied = on_applied
        self.ring: TokenRing | None = None
        self.hashes: dict[int, str] = {}
        """Parameter hash after every applied step (``tokenring.record_hashes``)."""
        self.last_applied = 0
        self.steps_applied = 0
        """Steps this process applied (the denominator of its bytes per step)."""
        self._step, self._t0 = 0, 0.0
        self._computes: list[float] = []
        self.step_start: dict[int, float] = {}
        """Wall time (``time.time()``) at which this node began each step it computed."""
        self.applied_time: dict[int, float] = {}
        """Wall time at which each step's update was applied here."""
        self.snapshots: list[dict] = []
        """With ``record_weights``: ``{"step", "params"}`` after every applied step."""
        self.work: WorkQueue | None = None
        """Which unit of data each node trains in each step (:mod:`.work`)."""
        self.trained_units: dict[int, dict[int, Unit]] = {}
        """Per applied step: the unit each contributor trained."""
        self.read_units: dict[int, Unit] = {}
        """Per step this node computed: the unit it read."""

    def use(self, ring: TokenRing, applied: int, work: dict | None = None) -> None:
        """Exchange through ``ring`` from now on (after formation or a rejoin); ``work``: the
        data assignment's state after ``applied`` (from a welcome; None: a new run's)."""
        self.ring, self.last_applied = ring, applied
        self.work = (WorkQueue(self.cfg.nodes, applied) if work is None
                     else WorkQueue.from_json(work))

    def unit_for(self, step: int) -> Unit:
        """The ``(nominal step, shard)`` this node trains in ``step`` (every close before
        ``step`` applied, so every node computes the same assignment)."""
        if self.work.step != step - 1:
            raise RuntimeError(f"token ring node {self.index}: data of step {step} asked with "
                               f"the closes applied through step {self.work.step}")
        unit = self.work.assignment()[self.index]
        self.read_units[step] = unit
        return unit

    @property
    def _slow(self) -> bool:
        """This node emulates a slower machine in this step by idling (without pacing)."""
        return is_slow(self.cfg, self.index, self._step) and not self.cfg.pace_s

    def begin_step(self, step: int) -> bool:
        """Idle first if this node emulates a slow one; skip a step that closed meanwhile."""
        self._step = step
        self.step_start.setdefault(step, time.time())
        if self._slow and self._computes:
            # (factor-1) x the recent compute time, so the node uses as little CPU as a
            # slower machine would; a step that closes meanwhile is abandoned at once
            self.ring.wait_closed(step, (self.cfg.slow_factor - 1)
                                  * statistics.median(self._computes))
        self._t0 = time.perf_counter()
        return not self.ring.closed(step)

    def sync(self, params: list) -> None:
        """Offer this node's gradient of the step (unless the step closed meanwhile), then
        wait for the step to close."""
        r, step, ring = self.cfg, self._step, self.ring
        compute = time.perf_counter() - self._t0
        self._computes = [*self._computes[-4:], compute]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        for p in params:
            p.grad = None  # the ring keeps the offered tensors; the next backward starts anew
        far_behind = False  # the step closed while this node emulated a slower device
        if self._slow and len(self._computes) == 1:  # no estimate before the first step
            far_behind = ring.wait_closed(step, (r.slow_factor - 1) * compute)
        if r.pace_s:  # pad forward+backward to the target time, as on a dedicated device
            target = r.pace_s * (r.slow_factor if is_slow(r, self.index, step) else 1.0)
            ready_at = self._t0 + target
            if ring.wait_closed(step, target - compute):  # closed before the emulated end
                far_behind |= ready_at - time.perf_counter() > r.close_grace_s
        if self.fault is not None:
            self.fault.check(step)
        if not ring.closed(step):
            ring.offer(step, grads)
        elif not far_behind:  # ready (or nearly), after the close: the ring learns it
            ring.late(step)
        ring.wait_close(step)

    def weight_update(self, stage) -> WeightUpdate:
        """Applies every step the ring has closed since the last one applied."""
        return RingUpdate(self, stage)

    def applied_through(self, step: int) -> int:
        """The last step applied (the ring may have closed several)."""
        return self.last_applied

    def apply(self, step: int, layers: LayerOptimizers) -> None:
        """``p.grad = sum / n`` (the step's closed sum, ``n`` its contributors), then every
        layer's optimizer (any ``torch.optim`` optimizer: the ring only decides what goes
        into ``p.grad``)."""
        ring = self.ring
        contributors = ring.close_of(step)
        total = ring.summed(step, contributors)
        slots = layers.stage.slots
        params = [p for slot in slots for p in slot.module.parameters()]
        for p, a in zip(params, total, strict=True):
            p.grad = a / len(contributors)  # a new tensor: the ring keeps the sum to serve
        self.trained_units[step] = self.work.close(step, contributors)
        layers.step()
        if self.cfg.record_hashes:
            self.hashes[step] = param_hash(params)
        self.applied_time[step] = time.time()
        if self.cfg.record_weights:
            self.snapshots.append({"step": step, "params": [p.detach().clone() for p in params]})
        self.last_applied = step
        self.steps_applied += 1
        every = self.cfg.batch_steps
        if ring.wants_weights(step, every):  # admitting: parameters and optimizer state
            tensors, skeleton = snapshot(slots)
            ring.note_applied(step, tensors, every, extra={"state": skeleton,
                                                           "work": self.work.to_json()})
        else:
            ring.note_applied(step, None, every)
        if self.on_applied is not None:
            self.on_applied(step, slots)


class RingUpdate(WeightUpdate):
    """The token ring's update: every step the ring closed since the last applied one goes
    into ``p.grad`` in turn and each layer's optimizer steps (:meth:`RingExchange.apply`).

    Args:
        exchange: the node's exchange.
        stage: the node's stage (the whole model).
    """

    def __init__(self, exchange: RingExchange, stage):
        self.exchange = exchange
        self._layers = LayerOptimizers(stage)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Each layer's own optimizer."""
        return self._layers.optimizers()

    def step(self) -> None:
        """Apply every closed step not applied yet, in order."""
        ex = self.exchange
        for s in range(ex.last_applied + 1, ex.ring.closed_through() + 1):
            ex.apply(s, self._layers)

    def skip(self) -> None:
        """Drop the node's gradients (the ring refuses fp16, so no step overflows)."""
        self._layers.skip()
