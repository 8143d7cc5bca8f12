"""The executor of interleaved schedules: one rank runs several model chunks.

A rank holds ``v`` :class:`~trainwright.pipeline.stage.Stage` objects, one per virtual
stage ``r, r + p, ...``, sharing one activation store and profiler. Its action list (from
:func:`~trainwright.schedule.interleaved.interleaved_1f1b`) names the virtual stage of
every action; activations of stage ``s`` go to the rank of ``s + 1``, gradients to the rank
of ``s - 1``. Each stream (direction, receiving virtual stage) travels on its own p2p tag,
so messages of different chunks between the same two ranks never match each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from trainwright.dist.comm import P2P
from trainwright.model.build import loss_fn
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.runtime import StepStats
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import ActivationStore
from trainwright.schedule.actions import COMPUTE, Action
from trainwright.schedule.carry import carried
from trainwright.sync import GradSync

__all__ = ["InterleavedRuntime", "chunk_tag", "chunk_stages"]


def chunk_stages(cfg, stages: list[int], parts: list[int], slots: list[LayerSlot],
                 store: ActivationStore, profiler: LayerProfiler) -> dict[int, Stage] | None:
    """One Stage per model chunk of this rank (None with one stage per rank).

    Args:
        cfg: the configuration (loss and micro-batches).
        stages: this rank's virtual stages; ``parts``: layers per virtual stage.
        slots: this rank's layers, all chunks; ``store``/``profiler``: shared by the chunks.
    """
    if len(stages) == 1:
        return None
    by_index = {slot.index: slot for slot in slots}
    n = len(parts)
    out = {}
    for k in stages:
        first = sum(parts[:k])
        out[k] = Stage([by_index[i] for i in range(first, first + parts[k])], store, profiler,
                       is_first=k == 0, loss_fn=loss_fn(cfg) if k == n - 1 else None,
                       loss_scale=1.0 / cfg.train.micro_batches)
    return out


def chunk_tag(kind: str, to_stage: int) -> int:
    """The p2p tag of the ``kind`` (``"act"``/``"grad"``) stream into virtual stage
    ``to_stage`` (never 0, the tag of one-stage-per-rank pipelines)."""
    return 1 + 2 * to_stage + (kind == "grad")


class InterleavedRuntime:
    """Runs a rank's chunks through its interleaved action list, one step at a time.

    Args:
        view: a stage over all the rank's layers (the trainer's: parameters, optimizers,
            ``fast`` and the store); its forward is not used.
        chunks: virtual stage -> its Stage (sharing ``view``'s store and profiler).
        actions: this rank's action list (one step).
        p2p: transfers to the other ranks of the pipeline.
        rank_of: virtual stage -> global rank holding it.
        grad_sync: averages gradients over replicas (SYNC) and updates (STEP).
        replica: this rank's data-parallel index; ``rank``: its pipeline index.
        fault: ``(step, action_index, action) -> None`` hook before each action (testing).
    """

    def __init__(self, view: Stage, chunks: dict[int, Stage], actions: list[Action], p2p: P2P,
                 *, rank_of: Callable[[int], int], grad_sync: GradSync, replica: int = 0,
                 rank: int = 0, fault: Callable[[int, int, Action], None] | None = None):
        self.view, self.chunks, self.actions, self.p2p = view, chunks, actions, p2p
        self.rank_of, self.grad_sync, self.replica = rank_of, grad_sync, replica
        self.stage_index, self.fault = rank, fault
        self.last = max(a.stage for a in actions if a.kind == "F")
        self.split = any(a.kind == "W" for a in actions)  # ZB-V: B then W
        for chunk in self.chunks.values():
            chunk.defer_weights = self.split and not chunk.is_first
        self.here = {a.stage for a in actions}
        """Virtual stages of this rank: a hand-over between two of them stays local."""
        self._local: dict[tuple, tuple] = {}
        self._linked = _receives_followed(actions, self.here) | _sends_after_first(
            actions, self.here)
        """Transfers whose stream carries another message after them (a receive) or before
        them (a send) in the step: their receives are posted ahead (P2P's note)."""
        self._measured_peak = 0
        self.carry = carried(actions)
        """Actions at the end of the list a step may leave to the next (``schedule.carry``)."""
        self._carried: list[Action] = []

    def run_step(self, step: int, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, trace: bool = False,
                 migration=None, carry: bool = False) -> StepStats:
        """One step: every chunk's forwards and backwards, sync, optimizer step.

        Args and returns: as :meth:`trainwright.pipeline.runtime.PipelineRuntime.run_step`
        (``inputs`` on the rank of stage 0, ``targets`` on the rank of the last stage; no
        migration: live migration is refused with interleaved schedules). ``carry``: leave
        this rank's last weight passes, sync and optimizer step to the start of the next
        ``run_step`` (or :meth:`flush`), see :mod:`trainwright.schedule.carry`.
        """
        if migration is not None:
            raise RuntimeError("live migration does not run with an interleaved schedule")
        view = self.view
        events, t_step = [], time.perf_counter_ns()
        # the last step's carried passes run first, under that step's settings
        compute_ns = self._run(step, self._carried, events, trace, offset=None)
        self._carried = []
        view.store.reset_peaks()
        for st in self.chunks.values():  # the trainer and update step set these on the view
            st.fast, st.measured_mb = view.fast, view.measured_mb
            st.autocast, st.loss_gradient = view.autocast, view.loss_gradient
        self._io = {"in": inputs, "tg": targets, "recv": {}, "out": {}, "gin": {},
                    "gout": {}, "loss": []}
        cut = len(self.actions) - (self.carry if carry else 0)
        compute_ns += self._run(step, self.actions[:cut], events, trace, offset=0)
        self._carried = self.actions[cut:]
        wall = (time.perf_counter_ns() - t_step) / 1e9
        view.profiler.end_step()
        losses = self._io.pop("loss")
        if not view.fast:
            self._measured_peak = view.store.peak_bytes
        return StepStats(step=step, stage=self.stage_index, replica=self.replica, wall_s=wall,
                         compute_s=compute_ns / 1e9,
                         loss=float(torch.stack(losses).sum()) if losses else None,
                         activation_peak_bytes=self._measured_peak,
                         held_microbatches_peak=view.store.peak_microbatches, events=events,
                         host_peak_bytes=view.store.peak_host_bytes)

    def flush(self) -> None:
        """Run the actions the last step carried, if any: call before anything reads this
        rank's weights or gradients between steps."""
        carried_now, self._carried = self._carried, []
        self._run(-1, carried_now, [], False, offset=None)

    def _run(self, step: int, actions: list[Action], events: list, trace: bool,
             offset: int | None) -> int:
        """Run ``actions`` (``offset``: their index in the step's list, for the fault hook and
        posted-ahead receives; None for carried ones). Returns their compute nanoseconds."""
        compute_ns = 0
        for j, a in enumerate(actions):
            i = None if offset is None else offset + j
            if self.fault is not None and i is not None:
                self.fault(step, i, a)
            t0 = time.perf_counter_ns()
            self._do(a, i in self._linked)
            t1 = time.perf_counter_ns()
            compute_ns += (t1 - t0) if a.kind in COMPUTE else 0
            if trace:
                events.append((a.kind, a.mb, time.time_ns() - (time.perf_counter_ns() - t0),
                               t1 - t0))
        return compute_ns

    def _do(self, a: Action, linked: bool = False) -> None:
        """Run one action of virtual stage ``a.stage`` (``linked``: a receive whose stream
        brings another message later in the step, or a send that follows another one on its
        stream)."""
        k, mb, s, io = a.kind, a.mb, a.stage, self._io
        key = (s, mb)
        if k == "RECV_F":
            io["recv"][key] = self._local.pop(("act", s, mb)) if s - 1 in self.here else \
                tuple(self.p2p.recv(self.rank_of(s - 1), "act", mb, tag=chunk_tag("act", s),
                                more=linked))
        elif k == "F":
            st = self.chunks[s]
            x = (io["in"][mb],) if s == 0 else io["recv"].pop(key)
            out = st.forward(mb, x, io["tg"][mb] if s == self.last and st.is_last else None)
            if st.is_last:
                io["loss"].append(out[0])
            else:
                io["out"][key] = out
        elif k == "SEND_F":
            self._send("act", s + 1, mb, io["out"].pop(key), linked)
        elif k == "RECV_B":
            io["gin"][key] = self._local.pop(("grad", s, mb)) if s + 1 in self.here else \
                tuple(self.p2p.recv(self.rank_of(s + 1), "grad", mb, tag=chunk_tag("grad", s),
                                more=linked))
        elif k == "B":
            st = self.chunks[s]
            g = st.backward(mb, None if st.is_last else io["gin"].pop(key), split=self.split)
            if s > 0:
                io["gout"][key] = g
        elif k == "W":
            self.chunks[s].backward_weight(mb)
        elif k == "SEND_B":
            self._send("grad", s - 1, mb, io["gout"].pop(key), linked)
        elif k == "SYNC":
            self.p2p.wait_sends()
            self.grad_sync.sync(self.view.parameters())
        elif k == "STEP":
            self.grad_sync.step(self.view.slots)
        else:  # pragma: no cover - interleaved lists hold no other kinds
            raise ValueError(f"unknown action {a} in an interleaved schedule")

    def _send(self, kind: str, to_stage: int, mb: int, tensors: tuple, ahead: bool) -> None:
        """To the rank of ``to_stage`` (``ahead``: its receive is posted already), or handed
        over locally when this rank holds it."""
        if to_stage in self.here:
            self._local[(kind, to_stage, mb)] = tuple(
                t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)
        else:
            self.p2p.send(self.rank_of(to_stage), kind, mb, tensors,
                          tag=chunk_tag(kind, to_stage), ahead=ahead)


_TRANSFER = {"RECV_F": ("F", 0, -1), "RECV_B": ("B", 0, 1), "SEND_F": ("F", 1, 1),
             "SEND_B": ("B", -1, -1)}
"""kind -> (direction, receiving stage - a.stage, other end's stage - a.stage)."""


def _remote_stream(a: Action, here: set[int]) -> tuple[str, int] | None:
    """The stream (direction, receiving virtual stage) that transfer ``a`` travels on, or
    None for a compute action or a hand-over between two chunks of this rank."""
    if a.kind not in _TRANSFER:
        return None
    direction, to, other = _TRANSFER[a.kind]
    return None if a.stage + other in here else (direction, a.stage + to)


def _receives_followed(actions: list[Action], here: set[int]) -> set[int]:
    """Indices of the receives from another rank after which the same stream receives again
    in the step: the next message's receives can be posted ahead."""
    out, seen = set(), set()
    for i in range(len(actions) - 1, -1, -1):
        stream = _remote_stream(actions[i], here)
        if stream is not None and actions[i].kind.startswith("RECV"):
            if stream in seen:
                out.add(i)
            seen.add(stream)
    return out


def _sends_after_first(actions: list[Action], here: set[int]) -> set[int]:
    """Indices of the sends to another rank that follow an earlier send of the same stream in
    the step: the receiver (:func:`_receives_followed`, its mirror) posted their receives
    ahead."""
    out, seen = set(), set()
    for i, a in enumerate(actions):
        stream = _remote_stream(a, here)
        if stream is not None and a.kind.startswith("SEND"):
            if stream in seen:
                out.add(i)
            seen.add(stream)
    return out
