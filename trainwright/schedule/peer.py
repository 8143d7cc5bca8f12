"""Peer-swap transfers as schedule actions, in the owner's and the peers' action lists (pure).

Peer swap moves saved tensors of a heavy stage ``s`` (the *owner*) to the spare memory of
later stages ``t > s`` (its *peers*). With gloo a send completes only once the matching
receive is posted, so every transfer must appear at a point of *both* ranks' schedules
where neither can wait on the other in a cycle. :func:`with_peer_swap` inserts, for owner
``s``, peer ``t`` and micro-batch ``m`` (``k`` = micro-batches ``s`` holds at most):

owner ``s``
    ``PEER_SEND(m)`` right after ``F(m)``: wait until the chunks packed during the forward
    have been delivered (their receive is already posted, see below);
    ``PEER_FETCH(m)`` before ``RECV_B(m)`` (before ``B(m)`` on the last stage): post the
    receives of the chunks coming back, so they travel while the stage waits for its
    gradient (the prefetch);
    ``PEER_WAIT(m)`` right before ``B(m)``: wait for them.

peer ``t``
    ``PEER_RECV(m)`` (post the receive, do not wait) at the start of the step for
    ``m < k``, and right after ``PEER_RETURN(m - k)`` for the others, so a peer never holds
    more than ``k`` micro-batches of the owner;
    ``PEER_RETURN(m)`` right after its own ``B(m)``: wait for the chunks of ``m`` and
    send them back (without waiting: the owner may still be busy with its forwards);
    ``PEER_SETTLE(m)`` just before ``PEER_RETURN(m + k)`` (before ``SYNC`` for the last
    ``k``): wait until ``m``'s chunks were delivered and free them. So a peer holds at
    most ``2k`` micro-batches of an owner's chunks.

Why it cannot deadlock: ``PEER_RETURN(m)`` on ``t`` waits for ``F(m)`` on ``s``, which
precedes ``t``'s own ``F(m)``; ``PEER_SETTLE(m)`` waits for ``PEER_FETCH(m)`` on ``s``,
which precedes ``s``'s ``F(m + k)`` and so ``t``'s ``B(m + k)``, after which it sits;
``PEER_WAIT(m)`` on ``s`` waits for ``t``'s ``B(m)``,
which precedes ``s``'s ``RECV_B(m)``; ``PEER_SEND(m + k)`` on ``s`` waits for
``PEER_RECV(m + k)``, posted after ``PEER_RETURN(m)``, which precedes ``s``'s ``B(m)``,
which precedes ``F(m + k)`` (at most ``k`` in flight). The simulator
(:func:`trainwright.plan.simulate.simulate`) replays the lists and checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwright.schedule.actions import Action, max_in_flight
from trainwright.schedule.base import PEER_KINDS, ActionKind

__all__ = ["PeerAction", "PEER_KINDS", "with_peer_swap"]

@dataclass(frozen=True)
class PeerAction(Action):
    """A peer-swap action: ``kind`` on micro-batch ``mb`` with stage ``peer`` (the other end)."""

    peer: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}@{self.peer}"


def with_peer_swap(schedule: list[list[Action]],
                   peers: dict[int, list[int]]) -> list[list[Action]]:
    """Insert the peer-swap actions of every owner into both ends' action lists.

    Args:
        schedule: one action list per stage (from
            :func:`~trainwright.schedule.actions.build_schedule`).
        peers: owner stage -> the later stages holding its chunks.

    Returns:
        New action lists (the input is not changed).

    Raises:
        ValueError: a peer that is not a later stage.
    """
    n = len(schedule)
    n_micro = sum(a.kind == ActionKind.F for a in schedule[0])
    for s, ts in peers.items():
        bad = [t for t in ts if not s < t < n]
        if bad:
            raise ValueError(f"stage {s}: peers {bad} must be later stages (< {n}); a peer "
                             f"before its owner has no point between the owner's forward "
                             f"and backward to hold the chunks")
    before: dict[tuple[int, int], list[Action]] = {}  # (stage, action index) -> inserted before
    after: dict[tuple[int, int], list[Action]] = {}
    start: dict[int, list[Action]] = {}
    for s, ts in sorted(peers.items()):
        if not ts:
            continue
        acts = schedule[s]
        k = max_in_flight(acts)
        for i, a in enumerate(acts):
            if a.kind == ActionKind.F:
                after.setdefault((s, i), []).extend(
                    PeerAction(s, ActionKind.PEER_SEND, a.mb, t) for t in ts)
            elif a.kind == ActionKind.B:
                j = i - 1 if i > 0 and acts[i - 1].kind == ActionKind.RECV_B else i
                before.setdefault((s, j), []).extend(
                    PeerAction(s, ActionKind.PEER_FETCH, a.mb, t) for t in ts)
                before.setdefault((s, i), []).extend(
                    PeerAction(s, ActionKind.PEER_WAIT, a.mb, t) for t in ts)
        for t in ts:
            start.setdefault(t, []).extend(PeerAction(t, ActionKind.PEER_RECV, m, s)
                                           for m in range(min(k, n_micro)))
            for i, a in enumerate(schedule[t]):
                if a.kind == ActionKind.B:
                    extra = []
                    if a.mb - k >= 0:
                        extra.append(PeerAction(t, ActionKind.PEER_SETTLE, a.mb - k, s))
                    extra.append(PeerAction(t, ActionKind.PEER_RETURN, a.mb, s))
                    if a.mb + k < n_micro:
                        extra.append(PeerAction(t, ActionKind.PEER_RECV, a.mb + k, s))
                    after.setdefault((t, i), []).extend(extra)
                elif a.kind == ActionKind.SYNC:
                    before.setdefault((t, i), []).extend(
                        PeerAction(t, ActionKind.PEER_SETTLE, m, s)
                        for m in range(max(0, n_micro - k), n_micro))
    out = []
    for s, acts in enumerate(schedule):
        new = list(start.get(s, []))
        for i, a in enumerate(acts):
            new += before.get((s, i), [])
            new.append(a)
            new += after.get((s, i), [])
        out.append(new)
    return out
