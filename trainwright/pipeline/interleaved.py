"""The executor of interleaved schedules: one rank runs several model chunks.

A rank holds ``v`` :class:`~trainwright.pipeline.stage.Stage` objects, one per virtual
stage ``r, r + p, ...``, sharing one activation store and profiler. Its action list (from
:func:`~trainwright.schedule.interleaved.interleaved_1f1b`) names the virtual stage of
every action; activations of stage ``s`` go to the rank of ``s + 1``, gradients to the rank
of ``s - 1``. Each stream (direction, receiving virtual stage) travels on its own p2p tag,
so messages of different chunks between the same two ranks never match each other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainwright.dist.comm import P2P
from trainwright.dist.faults import FaultPoint
from trainwright.model.build import loss_fn
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.runtime import Runtime, StepHooks
from trainwright.pipeline.stage import LayerSlot, Stage, StageOptions
from trainwright.pipeline.store import ActivationStore
from trainwright.schedule.base import Action, ActionKind
from trainwright.schedule.carry import carried

__all__ = ["InterleavedRuntime", "chunk_tag", "chunk_stages"]


def chunk_stages(cfg, stages: list[int], parts: list[int], slots: list[LayerSlot],
                 store: ActivationStore, profiler: LayerProfiler,
                 options: StageOptions) -> dict[int, Stage] | None:
    """One Stage per model chunk of this rank (None with one stage per rank).

    Args:
        cfg: the configuration (loss and micro-batches).
        stages: this rank's virtual stages; ``parts``: layers per virtual stage.
        slots: this rank's layers, all chunks; ``store``/``profiler``/``options``: shared by
            the chunks.
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
                       loss_scale=1.0 / cfg.train.micro_batches, options=options)
    return out


def chunk_tag(kind: str, to_stage: int) -> int:
    """The p2p tag of the ``kind`` (``"act"``/``"grad"``) stream into virtual stage
    ``to_stage`` (never 0, the tag of one-stage-per-rank pipelines)."""
    return 1 + 2 * to_stage + (kind == "grad")


class InterleavedRuntime(Runtime):
    """Runs a rank's chunks through its interleaved action list, one step at a time.

    Args:
        view: a stage over all the rank's layers (the trainer's: parameters, optimizers,
            options and the store); its forward is not used.
        chunks: virtual stage -> its Stage (sharing ``view``'s store, profiler and options).
        actions: this rank's action list (one step).
        p2p: transfers to the other ranks of the pipeline.
        hooks: the trainer's ``SYNC`` and ``STEP``.
        rank_of: virtual stage -> global rank holding it.
        replica: this rank's data-parallel index; ``rank``: its pipeline index.
        fault: where a test's fault may strike (:mod:`trainwright.dist.faults`).
    """

    def __init__(self, view: Stage, chunks: dict[int, Stage], actions: list[Action], p2p: P2P,
                 hooks: StepHooks, *, rank_of: Callable[[int], int], replica: int = 0,
                 rank: int = 0, fault: FaultPoint | None = None):
        super().__init__(view, actions, p2p, hooks, replica=replica, rank=rank, fault=fault)
        self.chunks, self.rank_of = chunks, rank_of
        self.last = max(a.stage for a in actions if a.kind == ActionKind.F)
        self.here = {a.stage for a in actions}
        """Virtual stages of this rank: a hand-over between two of them stays local."""
        self._local: dict[tuple, tuple] = {}
        self._linked = _receives_followed(actions, self.here) | _sends_after_first(
            actions, self.here)
        """Transfers whose stream carries another message after them (a receive) or before
        them (a send) in the step: their receives are posted ahead (P2P's note)."""
        self.carry = carried(actions)
        """Actions at the end of the list a step may leave to the next (``schedule.carry``)."""
        self._carried: list[Action] = []
        self.handlers.update({
            ActionKind.RECV_F: self._recv_f, ActionKind.F: self._forward,
            ActionKind.SEND_F: self._send_f, ActionKind.RECV_B: self._recv_b,
            ActionKind.B: self._backward, ActionKind.W: self._weights,
            ActionKind.SEND_B: self._send_b})

    def _before_step(self, step: int, events: list, trace: bool) -> int:
        """The last step's carried passes run first, under that step's settings."""
        carried_now, self._carried = self._carried, []
        return self._run(step, carried_now, events, trace, offset=None)

    def _begin(self, inputs, targets, migration) -> None:
        if migration is not None:
            raise RuntimeError("live migration does not run with an interleaved schedule")
        self._io = {"in": inputs, "tg": targets, "recv": {}, "out": {}, "gin": {},
                    "gout": {}, "loss": []}

    def _step_actions(self, migration, carry: bool) -> list[Action]:
        """The step's list, less the actions it leaves to the next step when carrying."""
        cut = len(self.actions) - (self.carry if carry else 0)
        self._carried = self.actions[cut:]
        return self.actions[:cut]

    def _losses(self) -> list[torch.Tensor]:
        return self._io.pop("loss")

    def flush(self) -> None:
        """Run the actions the last step carried, if any: call before anything reads this
        rank's weights or gradients between steps."""
        carried_now, self._carried = self._carried, []
        self._run(-1, carried_now, [], False, offset=None)

    @property
    def _linked_now(self) -> bool:
        """The running transfer's stream brings another message later in the step (a
        receive), or follows another one (a send)."""
        return self._index in self._linked

    def _recv_f(self, a: Action) -> None:
        s, mb = a.stage, a.mb
        self._io["recv"][(s, mb)] = self._local.pop(("act", s, mb)) if s - 1 in self.here \
            else tuple(self.p2p.recv(self.rank_of(s - 1), "act", mb, tag=chunk_tag("act", s),
                                     more=self._linked_now))

    def _forward(self, a: Action) -> None:
        s, mb, io = a.stage, a.mb, self._io
        st = self.chunks[s]
        x = (io["in"][mb],) if s == 0 else io["recv"].pop((s, mb))
        out = st.forward(mb, x, io["tg"][mb] if s == self.last and st.is_last else None)
        if st.is_last:
            io["loss"].append(out[0])
        else:
            io["out"][(s, mb)] = out

    def _send_f(self, a: Action) -> None:
        self._send("act", a.stage + 1, a.mb, self._io["out"].pop((a.stage, a.mb)))

    def _recv_b(self, a: Action) -> None:
        s, mb = a.stage, a.mb
        self._io["gin"][(s, mb)] = self._local.pop(("grad", s, mb)) if s + 1 in self.here \
            else tuple(self.p2p.recv(self.rank_of(s + 1), "grad", mb,
                                     tag=chunk_tag("grad", s), more=self._linked_now))

    def _backward(self, a: Action) -> None:
        s, mb, io = a.stage, a.mb, self._io
        st = self.chunks[s]
        g = st.backward(mb, None if st.is_last else io["gin"].pop((s, mb)), split=self.split)
        if s > 0:
            io["gout"][(s, mb)] = g

    def _weights(self, a: Action) -> None:
        self.chunks[a.stage].backward_weight(a.mb)

    def _send_b(self, a: Action) -> None:
        self._send("grad", a.stage - 1, a.mb, self._io["gout"].pop((a.stage, a.mb)))

    def _send(self, kind: str, to_stage: int, mb: int, tensors: tuple) -> None:
        """To the rank of ``to_stage`` (its receive is posted already when the stream carried
        a message before), or handed over locally when this rank holds it."""
        if to_stage in self.here:
            self._local[(kind, to_stage, mb)] = tuple(
                t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)
        else:
            self.p2p.send(self.rank_of(to_stage), kind, mb, tensors,
                          tag=chunk_tag(kind, to_stage), ahead=self._linked_now)


_TRANSFER = {ActionKind.RECV_F: ("F", 0, -1), ActionKind.RECV_B: ("B", 0, 1),
             ActionKind.SEND_F: ("F", 1, 1), ActionKind.SEND_B: ("B", -1, -1)}
"""kind -> (direction, receiving stage - a.stage, other end's stage - a.stage)."""
_RECEIVES = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})


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
        if stream is not None and actions[i].kind in _RECEIVES:
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
        if stream is not None and a.kind in _SENDS:
            if stream in seen:
                out.add(i)
            seen.add(stream)
    return out
