"""The executors: interpret a rank's action list for one training step.

The same ``Action`` lists that :mod:`trainwright.schedule.actions` prints (and that a
simulator replays) drive the run here, one action at a time, each through one dispatch
table keyed by its kind; every action becomes a trace event. Sends are asynchronous and
drained before the gradient sync; receives block with a deadline.

:class:`Runtime` holds what every executor shares: the step loop, the table, the ``SYNC``
and ``STEP`` actions (which call the trainer's :class:`StepHooks`) and the step's figures.
:class:`PipelineRuntime` runs one stage per rank (with live migration and peer-swap
actions); :class:`~trainwright.pipeline.interleaved.InterleavedRuntime` runs several
chunks per rank.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainwright.dist.comm import P2P
from trainwright.dist.faults import FaultPoint
from trainwright.pipeline.stage import Stage
from trainwright.schedule.actions import COMPUTE, Action
from trainwright.schedule.base import MIG_KINDS, ActionKind

__all__ = ["StepStats", "StepHooks", "Runtime", "PipelineRuntime", "allocator_figures"]


class LiveMigration(Protocol):
    """What a step needs of a live layer migration (``trainwright.rebalance.migration``'s
    ``Migration``, a package above this one)."""

    plan: Any
    """``plan.actions[stage]``: the step's action list, ``MIG_*`` actions included."""
    ctrl: P2P
    """The control-group P2P whose sends are drained before the gradient sync."""
    stats: Any
    """``stats.to_dict()``: what this stage did, for :class:`StepStats`."""

    def run(self, action: Action) -> None:
        """Execute one ``MIG_*`` action."""


@dataclass
class StepStats:
    """What one stage measured during one step."""

    step: int
    stage: int
    replica: int
    wall_s: float
    compute_s: float
    loss: float | None
    activation_peak_bytes: int
    held_microbatches_peak: int
    host_peak_bytes: int = 0
    """Activations swapped to host memory, at most, during the step."""
    swap_copy_cpu_s: float = 0.0
    """Thread CPU seconds of the step's host-swap copies (CPU only; see
    :meth:`~trainwright.pipeline.swap.HostSwap.take_copies`)."""
    swap_copied_bytes: int = 0
    """Bytes of those copies."""
    memory_plan: list | None = None
    """Per-layer rows of a memory plan made just before this step (None: unchanged)."""
    cuda_max_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step (CUDA only)."""
    cuda_activation_peak_bytes: int | None = None
    """The CUDA allocator's peak over the step less what it held when the step began
    (weights, optimizer state) and the stage's gradients (set to None between steps, so
    allocated during it): the activations and working set, by the allocator (CUDA only)."""
    events: list = field(default_factory=list)
    """``(kind, mb, start_ns, dur_ns)`` per action, when tracing."""
    migration: dict | None = None
    """What this stage did in a layer migration during the step (None: no migration)."""
    decision: dict | None = None
    """A re-partition decided on this (last) stage after the step."""
    update: dict = field(default_factory=dict)
    """The optimizer step's figures (``lr``, ``grad_norm``, ``loss_scale``, ``skipped``)."""
    layer_costs: list[dict] | None = None
    """This stage's per-layer cost table, at a profile step whose costs travel to rank 0
    with the stats rather than through a collective (``Trainer._profile_and_check``)."""
    process_peak_bytes: int | None = None
    """The rank's peak resident memory over the step (set when its row is recorded)."""

    @property
    def idle_s(self) -> float:
        """Time in the step not spent in forward or backward compute."""
        return max(self.wall_s - self.compute_s, 0.0)


@dataclass(frozen=True)
class StepHooks:
    """What the trainer does at the schedule's ``SYNC`` and ``STEP`` actions
    (``Trainer.sync_gradients`` and ``Trainer.update_weights``)."""

    sync: Callable[[bool], None]
    """Sync the gradients over the replicas; its argument: the stage's layers changed in
    this step (a migration), so the exchange must learn them first."""
    update: Callable[[], None]
    """Unscale and clip the synced gradients, step the optimizers and the learning rate."""


def allocator_figures(now: int, params: list[torch.Tensor], start_bytes: int,
                      updates: list[tuple[int, int]]) -> dict:
    """The CUDA allocator's peak over a step, whole and as activations
    (:attr:`StepStats.cuda_activation_peak_bytes`).

    Args:
        now: ``torch.cuda.max_memory_allocated`` at the step's end.
        params: the stage's parameters (their gradients are taken off).
        start_bytes: allocated when the step began.
        updates: per optimizer step run in the step, the allocator's peak before it and the
            bytes it left allocated (the optimizer state the first creates); the peak
            counter was reset before each, so the state is taken off what follows it.
    """
    grown = sum(g for _, g in updates)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return {"cuda_max_allocated_bytes": max([now, *(p for p, _ in updates)]),
            "cuda_activation_peak_bytes": max([now - grown, *(p for p, _ in updates)])
            - start_bytes - grads}


class Runtime(ABC):
    """The step loop every executor shares: runs a rank's action list through a dispatch
    table keyed by action kind, timing and tracing every action.

    Args:
        view: a stage over all the rank's layers (parameters, store, profiler, options).
        actions: the rank's action list (one step).
        p2p: transfers to the other ranks of the pipeline.
        hooks: the trainer's ``SYNC`` and ``STEP``.
        replica / rank: this rank's data-parallel and pipeline index (for the stats).
        fault: where a test's fault may strike, checked before each action of the step's
            list with ``(index, action)`` (:mod:`trainwright.dist.faults`; None: never).
    """

    def __init__(self, view: Stage, actions: list[Action], p2p: P2P, hooks: StepHooks, *,
                 replica: int = 0, rank: int = 0,
                 fault: FaultPoint | None = None):
        self.view, self.actions, self.p2p, self.hooks = view, actions, p2p, hooks
        self.replica, self.stage_index, self.fault = replica, rank, fault
        self.split = view.options.split_backward
        """Zero-bubble schedule: ``B`` computes input gradients only, ``W`` the weights'."""
        self.handlers: dict[ActionKind, Callable[[Action], None]] = {
            ActionKind.SYNC: self._sync, ActionKind.STEP: self._update}
        """Action kind -> what runs it; each executor adds its own kinds."""
        self.after: Callable[[Action], None] | None = None
        """Called after every action (the peer-swap extension's bookkeeping)."""
        self._measured_peak = 0
        self._cuda: torch.device | None = None
        """The stage's CUDA device while a step runs there (None: not on CUDA)."""
        self._updates: list[tuple[int, int]] = []
        """This step's optimizer steps on CUDA: (allocator peak before, bytes added)."""
        self._index: int | None = None
        """Index of the running action in the step's list (None: carried from the last)."""

    def run_step(self, step: int, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, trace: bool = False,
                 migration: LiveMigration | None = None, carry: bool = False) -> StepStats:
        """Run one step: every micro-batch forward and backward, sync, optimizer step.

        Args:
            step: step number (for stats and the fault hook).
            inputs: micro-batch inputs (on the rank of the first stage only).
            targets: micro-batch targets (on the rank of the last stage only).
            trace: whether to record an event per action.
            migration: this step moves layers (:class:`PipelineRuntime` only): its actions
                (with the ``MIG_*`` ones) replace the regular schedule.
            carry: leave this rank's last weight passes, sync and optimizer step to the
                start of the next step (:class:`InterleavedRuntime` only).

        Returns:
            The stage's measurements; ``loss`` is the step's mean loss on the last stage.
        """
        view = self.view
        events: list = []
        t_step = time.perf_counter_ns()
        compute_ns = self._before_step(step, events, trace)
        view.store.reset_peaks()
        view.store.swap.take_copies()  # a new window, like the peaks
        params = view.parameters()
        cuda = bool(params) and params[0].is_cuda
        self._cuda, self._updates = (params[0].device if cuda else None), []
        if cuda:
            torch.cuda.reset_peak_memory_stats(params[0].device)
            cuda_start = torch.cuda.memory_allocated(params[0].device)
        self._begin(inputs, targets, migration)
        compute_ns += self._run(step, self._step_actions(migration, carry), events, trace,
                                offset=0)
        wall = (time.perf_counter_ns() - t_step) / 1e9
        view.profiler.end_step()
        losses = self._losses()
        copy_cpu_s, copied = view.store.swap.take_copies()
        if not view.fast:  # a fast step fuses layers unmeasured: report the last measured peak
            self._measured_peak = view.store.peak_bytes
        return StepStats(step=step, stage=self.stage_index, replica=self.replica, wall_s=wall,
                         compute_s=compute_ns / 1e9,
                         loss=float(torch.stack(losses).sum()) if losses else None,
                         activation_peak_bytes=self._measured_peak,
                         held_microbatches_peak=view.store.peak_microbatches, events=events,
                         host_peak_bytes=view.store.peak_host_bytes,
                         swap_copy_cpu_s=copy_cpu_s, swap_copied_bytes=copied,
                         **(allocator_figures(torch.cuda.max_memory_allocated(self._cuda), params,
                                              cuda_start, self._updates) if cuda else {}),
                         migration=self._migration_stats(migration))

    def _run(self, step: int, actions: list[Action], events: list, trace: bool,
             offset: int | None) -> int:
        """Run ``actions`` (``offset``: their index in the step's list, for the fault hook;
        None for actions carried from the last step). Returns their compute nanoseconds."""
        compute_ns = 0
        for j, a in enumerate(actions):
            self._index = None if offset is None else offset + j
            if self.fault is not None and self._index is not None:
                self.fault.check(step, (self._index, a))
            t0 = time.perf_counter_ns()
            handler = self.handlers.get(a.kind)
            if handler is None:
                raise ValueError(f"{type(self).__name__} cannot run action {a}: no handler "
                                 f"for kind {a.kind!r} (it runs {sorted(self.handlers)})")
            handler(a)
            if self.after is not None:
                self.after(a)
            t1 = time.perf_counter_ns()
            if a.kind in COMPUTE:
                compute_ns += t1 - t0
            if trace or self._traced(a):
                events.append((a.kind, a.mb, time.time_ns() - (time.perf_counter_ns() - t0),
                               t1 - t0))
        return compute_ns

    def _update(self, a: Action) -> None:
        """``STEP``: the trainer's optimizer step. On CUDA the allocator's peak so far is
        kept and its counter reset, so that the optimizer state the first step creates is
        not counted as activations afterwards (see :func:`allocator_figures`)."""
        if self._cuda is None:
            self.hooks.update()
            return
        before, peak = torch.cuda.memory_allocated(self._cuda), \
            torch.cuda.max_memory_allocated(self._cuda)
        torch.cuda.reset_peak_memory_stats(self._cuda)
        self.hooks.update()
        self._updates.append((peak, torch.cuda.memory_allocated(self._cuda) - before))

    def _sync(self, a: Action) -> None:
        """``SYNC``: drain this rank's sends, then the trainer syncs the gradients."""
        self.p2p.wait_sends()
        self.hooks.sync(False)

    def flush(self) -> None:  # noqa: B027 - only executors that carry work override it
        """Run what the last step left to the next (nothing here): call before anything
        reads this rank's weights or gradients between steps."""

    # what each executor adds ------------------------------------------------------
    def _before_step(self, step: int, events: list, trace: bool) -> int:
        """Work that runs before the step's own list; returns its compute nanoseconds."""
        return 0

    @abstractmethod
    def _begin(self, inputs, targets, migration: LiveMigration | None) -> None:
        """Take the step's inputs and targets (and migration)."""

    def _step_actions(self, migration, carry: bool) -> list[Action]:
        """The list this step runs."""
        return self.actions

    @abstractmethod
    def _losses(self) -> list[torch.Tensor]:
        """The micro-batch losses the step computed here (last stage only)."""

    def _traced(self, a: Action) -> bool:
        """Whether ``a`` is traced even when the step is not."""
        return False

    def _migration_stats(self, migration) -> dict | None:
        return None


class PipelineRuntime(Runtime):
    """Runs a stage (one per rank) through its schedule, one step at a time.

    Args:
        stage: the layers of this rank.
        actions: this stage's action list (one step).
        p2p: transfers to the neighbouring stages.
        hooks: the trainer's ``SYNC`` and ``STEP``.
        prev_rank / next_rank: global ranks of the neighbours (None at the ends).
        replica: this rank's data-parallel index (for the stats).
        fault: where a test's fault may strike (:mod:`trainwright.dist.faults`).
        extensions: handlers of action kinds beyond the built-in ones (e.g. the peer-swap
            actions of :mod:`trainwright.pipeline.peerswap`).
        after: called after every action (the peer swap's bookkeeping).
    """

    def __init__(self, stage: Stage, actions: list[Action], p2p: P2P, hooks: StepHooks, *,
                 prev_rank: int | None, next_rank: int | None, replica: int = 0,
                 fault: FaultPoint | None = None,
                 extensions: dict[ActionKind, Callable[[Action], None]] | None = None,
                 after: Callable[[Action], None] | None = None):
        super().__init__(stage, actions, p2p, hooks, replica=replica, rank=actions[0].stage,
                         fault=fault)
        self.stage = stage
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.after = after
        self.handlers.update({
            ActionKind.RECV_F: self._recv_f, ActionKind.F: self._forward,
            ActionKind.SEND_F: self._send_f, ActionKind.RECV_B: self._recv_b,
            ActionKind.B: self._backward, ActionKind.W: self._weights,
            ActionKind.SEND_B: self._send_b,
            **{k: self._migrate for k in MIG_KINDS}, **(extensions or {})})
        self._migration = None

    def _begin(self, inputs, targets, migration) -> None:
        self._inputs, self._targets, self._migration = inputs, targets, migration
        self._received: dict[int, tuple] = {}
        self._outputs: dict[int, tuple] = {}
        self._grads_in: dict[int, tuple] = {}
        self._grads_out: dict[int, tuple] = {}
        self._loss_list: list[torch.Tensor] = []

    def _step_actions(self, migration, carry: bool) -> list[Action]:
        return self.actions if migration is None else migration.plan.actions[self.stage_index]

    def _losses(self) -> list[torch.Tensor]:
        return self._loss_list

    def _traced(self, a: Action) -> bool:
        return a.kind in MIG_KINDS

    def _migration_stats(self, migration) -> dict | None:
        return migration.stats.to_dict() if migration is not None else None

    def _recv_f(self, a: Action) -> None:
        self._received[a.mb] = tuple(self.p2p.recv(self.prev_rank, "act", a.mb))

    def _forward(self, a: Action) -> None:
        st, mb = self.stage, a.mb
        x = (self._inputs[mb],) if st.is_first else self._received.pop(mb)
        out = st.forward(mb, x, self._targets[mb] if st.is_last else None)
        if st.is_last:
            self._loss_list.append(out[0])
        else:
            self._outputs[mb] = out

    def _send_f(self, a: Action) -> None:
        self.p2p.send(self.next_rank, "act", a.mb, self._outputs.pop(a.mb))

    def _recv_b(self, a: Action) -> None:
        self._grads_in[a.mb] = tuple(self.p2p.recv(self.next_rank, "grad", a.mb))

    def _backward(self, a: Action) -> None:
        st = self.stage
        g = st.backward(a.mb, None if st.is_last else self._grads_in.pop(a.mb),
                        split=self.split)
        if not st.is_first:
            self._grads_out[a.mb] = g

    def _weights(self, a: Action) -> None:
        self.stage.backward_weight(a.mb)

    def _send_b(self, a: Action) -> None:
        self.p2p.send(self.prev_rank, "grad", a.mb, self._grads_out.pop(a.mb))

    def _sync(self, a: Action) -> None:
        """``SYNC``; in a migration step the moved layers' control messages are drained too
        and the trainer's sync learns the stage's new layers."""
        self.p2p.wait_sends()
        if self._migration is not None:
            self._migration.ctrl.wait_sends()
        self.hooks.sync(self._migration is not None)

    def _migrate(self, a: Action) -> None:
        if self._migration is None:
            raise ValueError(f"action {a} outside a migration step")
        self._migration.run(a)
