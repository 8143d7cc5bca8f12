"""Dry-running a step's action lists across stages to find deadlocks before any process starts.

As torch pipelining does with its schedules, :func:`check_schedule` plays every stage's
list the way the runtime executes it: sends never block, a receive waits for its message,
and ``SYNC`` waits until every earlier send of its stage has been received (the runtime
drains its sends there). :func:`_messages` says, in one place, which messages each action
kind waits for and sends; live-migration actions (``MIG_*``, see
:mod:`trainwright.rebalance.moves`) are among them, since a migration step's lists are
checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from trainwright.errors import PlanError
from trainwright.schedule.base import Action, ActionKind

__all__ = ["check_schedule"]


_MESSAGES: dict[ActionKind, Callable[[int, int], tuple[list, list]]] = {
    ActionKind.SEND_F: lambda s, mb: ([], [("act", s, mb)]),
    ActionKind.RECV_F: lambda s, mb: ([("act", s - 1, mb)], []),
    ActionKind.SEND_B: lambda s, mb: ([], [("grad", s, mb)]),
    ActionKind.RECV_B: lambda s, mb: ([("grad", s + 1, mb)], []),
    ActionKind.MIG_PREPARE: lambda s, mb: ([], [("prepare", mb)]),
    ActionKind.MIG_ACCEPT: lambda s, mb: ([("prepare", mb)], [("ready", mb)]),
    ActionKind.MIG_SEND: lambda s, mb: ([("ready", mb)], [("package", mb)]),
    ActionKind.MIG_RECV: lambda s, mb: ([("package", mb)], []),
    ActionKind.MIG_FINISH: lambda s, mb: ([], [("final", mb)]),
    ActionKind.MIG_ADOPT: lambda s, mb: ([("final", mb)], []),
}
"""Action kind -> ``(stage, mb) -> (waits_for, sends)`` message keys; other kinds neither
wait nor send."""


def _messages(a: Action) -> tuple[list, list]:
    """``(waits_for, sends)`` message keys of one action."""
    rule = _MESSAGES.get(a.kind)
    return rule(a.stage, a.mb) if rule is not None else ([], [])


def check_schedule(schedules: list[list[Action]]) -> None:
    """Dry-run the action lists as the runtime executes them; raise PlanError on a deadlock.

    Sends never block; a receive waits for its message; ``SYNC`` waits until every earlier
    send of its stage has been received (the runtime drains its sends there).
    """
    pos = [0] * len(schedules)
    sent: dict = {}  # key -> stage that sent it
    received: set = set()
    pending_sends: list[set] = [set() for _ in schedules]
    while any(p < len(acts) for p, acts in zip(pos, schedules, strict=True)):
        progressed = False
        for s, acts in enumerate(schedules):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                waits, sends = _messages(a)
                if any(w not in sent for w in waits):
                    break
                if a.kind == ActionKind.SYNC and pending_sends[s] - received:
                    break
                for w in waits:
                    received.add(w)
                for m in sends:
                    if m in sent:
                        raise PlanError(f"message {m} sent twice (second by {a})")
                    sent[m] = s
                    pending_sends[s].add(m)
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(acts[pos[s]]) for s, acts in enumerate(schedules)
                     if pos[s] < len(acts)}
            raise PlanError(f"schedule deadlocks; stages wait on {stuck}")
    unread = set(sent) - received
    if unread:
        raise PlanError(f"messages sent but never received: {sorted(unread)[:4]}")
