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

from trainwright.errors import PlanError
from trainwright.schedule.actions import Action

__all__ = ["check_schedule"]


def _messages(a: Action) -> tuple[list, list]:
    """``(waits_for, sends)`` message keys of one action."""
    s, k, mb = a.stage, a.kind, a.mb
    if k == "SEND_F":
        return [], [("act", s, mb)]
    if k == "RECV_F":
        return [("act", s - 1, mb)], []
    if k == "SEND_B":
        return [], [("grad", s, mb)]
    if k == "RECV_B":
        return [("grad", s + 1, mb)], []
    if k == "MIG_PREPARE":
        return [], [("prepare", mb)]
    if k == "MIG_ACCEPT":
        return [("prepare", mb)], [("ready", mb)]
    if k == "MIG_SEND":
        return [("ready", mb)], [("package", mb)]
    if k == "MIG_RECV":
        return [("package", mb)], []
    if k == "MIG_FINISH":
        return [], [("final", mb)]
    if k == "MIG_ADOPT":
        return [("final", mb)], []
    return [], []


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
                if a.kind == "SYNC" and pending_sends[s] - received:
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
