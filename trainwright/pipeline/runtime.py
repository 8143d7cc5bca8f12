"""The executor: interprets one stage's action list for one training step.

The same ``Action`` lists that :mod:`trainwright.schedule.actions` prints (and that a
simulator replays) drive the run here, one action at a time; every action becomes a trace
event. Sends are asynchronous and drained before the optimizer step; receives block with
a deadline.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainwright.dist.comm import P2P
from trainwright.pipeline.stage import Stage
from trainwright.schedule.actions import COMPUTE, Action
from trainwright.sync import GradSync

__all__ = ["StepStats", "PipelineRuntime"]


class LiveMigration(Protocol):
    """What a step needs of a live layer migration (``trainwright.rebalance.migration``'s
    ``Migration``, a package above this one)."""

    plan: Any
    """``plan.actions[stage]``: the step's action list, ``MIG_*`` actions included."""
    ctrl: P2P
    """The control-group P2P whose sends the exchange drains when layers changed."""
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
    memory_plan: list | None = None
    """Per-layer rows of a memory plan made just before this step (None: unchanged)."""
    cuda_max_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step (CUDA only)."""
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

    @property
    def idle_s(self) -> float:
        """Time in the step not spent in forward or backward compute."""
        return max(self.wall_s - self.compute_s, 0.0)


class PipelineRuntime:
    """Runs a stage through its schedule, one step at a time.

    Args:
        stage: the layers of this rank.
        actions: this stage's action list (one step).
        p2p: transfers to the neighbouring stages.
        prev_rank / next_rank: global ranks of the neighbours (None at the ends).
        grad_sync: averages gradients over replicas (SYNC action) and updates (STEP).
        replica: this rank's data-parallel index (for the stats).
        fault: ``(step, action_index, action) -> None`` hook called before each action (testing).
        extensions: handlers of action kinds beyond the built-in ones (e.g. the peer-swap
            actions of :mod:`trainwright.pipeline.peerswap`), and ``"after"``: a callable
            run after every action.
    """

    def __init__(self, stage: Stage, actions: list[Action], p2p: P2P, *,
                 prev_rank: int | None, next_rank: int | None,
                 grad_sync: GradSync, replica: int = 0,
                 fault: Callable[[int, int, Action], None] | None = None,
                 extensions: dict[str, Callable[[Action], None]] | None = None):
        self.stage, self.actions, self.p2p = stage, actions, p2p
        self.extensions = dict(extensions or {})
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.grad_sync, self.replica = grad_sync, replica
        self.fault = fault
        self.stage_index = actions[0].stage
        self.split = any(a.kind == "W" for a in actions)
        """Zero-bubble schedule: ``B`` computes input gradients only, ``W`` the weights'."""
        stage.defer_weights = self.split and not stage.is_first
        self._measured_peak = 0

    def run_step(self, step: int, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, trace: bool = False,
                 migration: LiveMigration | None = None) -> StepStats:
        """Run one step: every micro-batch forward and backward, sync, optimizer step.

        Args:
            step: step number (for stats and the fault hook).
            inputs: micro-batch inputs (first stage only).
            targets: micro-batch targets (last stage only).
            trace: whether to record an event per action.
            migration: this step moves layers: its actions (with the ``MIG_*`` ones) replace
                the regular schedule, and it executes them.

        Returns:
            The stage's measurements; ``loss`` is the step's mean loss on the last stage.
        """
        st = self.stage
        st.store.reset_peaks()
        params = st.parameters()
        cuda = bool(params) and params[0].is_cuda
        if cuda:
            torch.cuda.reset_peak_memory_stats(params[0].device)
        received: dict[int, tuple] = {}
        outputs: dict[int, tuple] = {}
        grads_in: dict[int, tuple] = {}
        grads_out: dict[int, tuple] = {}
        losses: list[torch.Tensor] = []
        events = []
        compute_ns = 0
        t_step = time.perf_counter_ns()
        actions = self.actions if migration is None else \
            migration.plan.actions[self.stage_index]
        for i, a in enumerate(actions):
            if self.fault is not None:
                self.fault(step, i, a)
            t0 = time.perf_counter_ns()
            k, mb = a.kind, a.mb
            if k == "RECV_F":
                received[mb] = tuple(self.p2p.recv(self.prev_rank, "act", mb))
            elif k == "F":
                x = (inputs[mb],) if st.is_first else received.pop(mb)
                out = st.forward(mb, x, targets[mb] if st.is_last else None)
                if st.is_last:
                    losses.append(out[0])
                else:
                    outputs[mb] = out
            elif k == "SEND_F":
                self.p2p.send(self.next_rank, "act", mb, outputs.pop(mb))
            elif k == "RECV_B":
                grads_in[mb] = tuple(self.p2p.recv(self.next_rank, "grad", mb))
            elif k == "B":
                g = st.backward(mb, None if st.is_last else grads_in.pop(mb), split=self.split)
                if not st.is_first:
                    grads_out[mb] = g
            elif k == "W":
                st.backward_weight(mb)
            elif k == "SEND_B":
                self.p2p.send(self.prev_rank, "grad", mb, grads_out.pop(mb))
            elif k == "SYNC":
                self.p2p.wait_sends()
                if migration is not None:  # the layers changed: the exchange follows them
                    migration.ctrl.wait_sends()
                    self.grad_sync.attach([slot.module for slot in st.slots])
                self.grad_sync.sync(st.parameters())
            elif k == "STEP":
                self.grad_sync.step(st.slots)
            elif k.startswith("MIG_") and migration is not None:
                migration.run(a)
            elif k in self.extensions:
                self.extensions[k](a)
            else:  # pragma: no cover - schedule.KINDS is closed
                raise ValueError(f"unknown action {a}")
            if "after" in self.extensions:
                self.extensions["after"](a)
            t1 = time.perf_counter_ns()
            if k in COMPUTE:
                compute_ns += t1 - t0
            if trace or k.startswith("MIG_"):
                events.append((k, mb, time.time_ns() - (time.perf_counter_ns() - t0), t1 - t0))
        wall = (time.perf_counter_ns() - t_step) / 1e9
        st.profiler.end_step()
        loss = float(torch.stack(losses).sum()) if losses else None
        if not st.fast:  # a fast step fuses layers unmeasured: report the last measured peak
            self._measured_peak = st.store.peak_bytes
        return StepStats(step=step, stage=self.stage_index, replica=self.replica, wall_s=wall,
                         compute_s=compute_ns / 1e9, loss=loss,
                         activation_peak_bytes=self._measured_peak,
                         held_microbatches_peak=st.store.peak_microbatches, events=events,
                         host_peak_bytes=st.store.peak_host_bytes,
                         cuda_max_allocated_bytes=(torch.cuda.max_memory_allocated(
                             params[0].device) if cuda else None),
                         migration=migration.stats.to_dict() if migration is not None else None)


def kill_self_at(kill_step: int, action_index: int,
                 kind: str = "") -> Callable[[int, int, Action], None]:
    """Fault hook that SIGKILLs this process in step ``kill_step``: before the first action
    of ``kind`` when given (e.g. ``"MIG_RECV"``), else before action ``action_index``."""

    def hook(step: int, i: int, action: Action) -> None:
        if step == kill_step and (action.kind == kind if kind else i == action_index):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
