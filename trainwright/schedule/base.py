"""The action type every schedule is made of, and the lowering of compute orders to actions."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from trainwright.errors import PlanError

__all__ = ["Action", "ActionKind", "COMM", "COMPUTE", "KINDS", "MIG_KINDS", "PEER_KINDS"]


class ActionKind(str, Enum):
    """What an :class:`Action` does (as torch pipelining's ``_ComputationType``).

    A ``str`` Enum whose names equal their values: a member compares and hashes equal to
    its name (``ActionKind.F == "F"``) and prints as it (``str``, ``format``, JSON, CSV), so
    schedules print exactly as before the type existed.
    """

    # compute
    F = "F"
    """Forward of one micro-batch."""
    B = "B"
    """Backward (with a split backward: input gradients only)."""
    W = "W"
    """Weight gradients of a split backward."""
    # transfers between neighbouring stages
    RECV_F = "RECV_F"
    SEND_F = "SEND_F"
    RECV_B = "RECV_B"
    SEND_B = "SEND_B"
    # end of step
    SYNC = "SYNC"
    """Data-parallel gradient reduction (drains the stage's sends first)."""
    STEP = "STEP"
    """Optimizer step."""
    # live layer migration (:mod:`trainwright.rebalance.moves`)
    MIG_PREPARE = "MIG_PREPARE"
    MIG_ACCEPT = "MIG_ACCEPT"
    MIG_SEND = "MIG_SEND"
    MIG_RECV = "MIG_RECV"
    MIG_FINISH = "MIG_FINISH"
    MIG_ADOPT = "MIG_ADOPT"
    # peer swap (:mod:`trainwright.schedule.peer`)
    PEER_SEND = "PEER_SEND"
    PEER_FETCH = "PEER_FETCH"
    PEER_WAIT = "PEER_WAIT"
    PEER_RECV = "PEER_RECV"
    PEER_RETURN = "PEER_RETURN"
    PEER_SETTLE = "PEER_SETTLE"

    def __str__(self) -> str:  # Enum's format() uses it too: f"{kind}" is the value
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> ActionKind:
        """``ActionKind(value)`` of no kind: a ValueError naming the known ones."""
        raise ValueError(f"unknown action kind {value!r}; known kinds: "
                         f"{', '.join(k.value for k in cls)}")


COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
"""Kinds that run model compute."""
COMM = frozenset({ActionKind.RECV_F, ActionKind.SEND_F, ActionKind.RECV_B,
                  ActionKind.SEND_B})
"""Kinds that move activations or gradients between neighbouring stages."""
KINDS = COMPUTE | COMM | {ActionKind.SYNC, ActionKind.STEP}
"""Kinds of a plain schedule (no migration, no peer swap)."""
MIG_KINDS = frozenset(k for k in ActionKind if k.name.startswith("MIG_"))
"""Kinds of a live migration (:func:`~trainwright.rebalance.moves.migration_schedule`)."""
PEER_KINDS = frozenset(k for k in ActionKind if k.name.startswith("PEER_"))
"""Kinds of a peer swap (:func:`~trainwright.schedule.peer.with_peer_swap`)."""


@dataclass(frozen=True)
class Action:
    """One thing a stage does: ``kind`` on micro-batch ``mb`` (``-1`` for SYNC/STEP).

    A ``kind`` given as a string is converted to its :class:`ActionKind` (ValueError when it
    names none).
    """

    stage: int
    kind: ActionKind
    mb: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}" + ("" if self.mb < 0 else str(self.mb))


def _lower(order: list[tuple[ActionKind, int, int]], n_stages: int,
           rank: int) -> list[Action]:
    """Lower a compute order of ``(kind, stage, mb)`` to actions with explicit send/recv
    around each forward and backward (none across the ends of the pipeline), then the
    ``SYNC`` and ``STEP`` of list ``rank``."""
    out: list[Action] = []
    for kind, s, mb in order:
        first, last = s == 0, s == n_stages - 1
        if kind == ActionKind.F:
            if not first:
                out.append(Action(s, ActionKind.RECV_F, mb))
            out.append(Action(s, ActionKind.F, mb))
            if not last:
                out.append(Action(s, ActionKind.SEND_F, mb))
        elif kind == ActionKind.W:
            out.append(Action(s, ActionKind.W, mb))
        else:
            if not last:
                out.append(Action(s, ActionKind.RECV_B, mb))
            out.append(Action(s, ActionKind.B, mb))
            if not first:
                out.append(Action(s, ActionKind.SEND_B, mb))
    return out + [Action(rank, ActionKind.SYNC), Action(rank, ActionKind.STEP)]


def _with_comm(stage: int, n_stages: int,
               compute: list[tuple[ActionKind, int]]) -> list[Action]:
    """Lower one stage's compute-only ``(kind, mb)`` pairs to actions with send/recv."""
    return _lower([(kind, stage, mb) for kind, mb in compute], n_stages, stage)


def _check(n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1:
        raise PlanError(f"need at least 1 stage and 1 micro-batch, got {n_stages} and {n_micro}")
