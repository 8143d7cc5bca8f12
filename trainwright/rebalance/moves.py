"""The move plan: which layers move where, and where in the schedule (pure: no torch, no processes).

A migration moves a run of layers from a *giver* stage to a neighbouring *receiver* stage
in the middle of a step. Everything is decided from the action lists alone, so every rank
of both stages agrees without extra round trips (design notes:
``docs/design/live-migration.md``):

* **Forward switch at micro-batch k**: micro-batches ``0..k`` run the moving layers on the
  giver, ``k+1..`` on the receiver. The giver acts right after its ``F(k)``
  (``MIG_SEND``: parameters and the stored inputs below), the receiver right before its
  ``F(k+1)`` (``MIG_RECV``). What crosses the stage boundary for a micro-batch is then
  fixed by its index on both sides.
* **Backward follows the segments**: a stage back-propagates, for each micro-batch, exactly
  the layers whose segments it holds (``Stage.backward``). A micro-batch forwarded on the
  giver that *neither* side has back-propagated at its migration point is *shipped*: the
  giver sends the moving layers' stored inputs (and RNG state) and the receiver rebuilds
  their graphs by recomputation. The others stay on the giver, which keeps the layers until
  its backward of them is done.
* Around that: ``MIG_PREPARE`` (giver, start of step: the layers' structure) and
  ``MIG_ACCEPT`` (receiver: builds them, answers *ready*, which ``MIG_SEND`` waits for);
  ``MIG_FINISH`` (giver, before ``SYNC``: accumulated gradients and optimizer state, then
  the layers are deleted) and ``MIG_ADOPT`` (receiver, before ``SYNC``: adds them).

Migration messages travel on a separate process group, so they never queue behind
activations; :func:`~trainwright.schedule.dryrun.check_schedule` dry-runs the lists (sends
asynchronous, receives and ``SYNC``'s drain of sends blocking) and raises on a deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwright.errors import PlanError
from trainwright.schedule.actions import Action
from trainwright.schedule.base import MIG_KINDS, ActionKind
from trainwright.schedule.dryrun import check_schedule

__all__ = ["Move", "MigrationSchedule", "one_hop_moves", "migration_schedule", "MIG_KINDS"]

@dataclass(frozen=True)
class Move:
    """A run of consecutive layers (model indices) moving between neighbouring stages."""

    layers: tuple[int, ...]
    giver: int
    receiver: int

    @property
    def downstream(self) -> bool:
        """True when the layers move to the next stage (the giver's last layers)."""
        return self.receiver == self.giver + 1

    def to_dict(self) -> dict:
        """Plain dict for metrics."""
        return {"layers": list(self.layers), "from": self.giver, "to": self.receiver}


@dataclass
class MigrationSchedule:
    """The action lists of a migration step and what each move ships.

    Attributes:
        actions: one list per stage, with the ``MIG_*`` actions inserted (``mb`` = move index).
        moves: the moves, indexed by the actions' ``mb``.
        switch_mb: ``k``: micro-batches ``> k`` run the moved layers on the receiver.
        shipped: per move, the micro-batches whose stored inputs travel to the receiver.
        kept: per move, the micro-batches the giver still back-propagates after ``MIG_SEND``.
    """

    actions: list[list[Action]]
    moves: list[Move]
    switch_mb: int
    shipped: list[list[int]] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)


def _bounds(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts[:-1]:
        acc += c
        out.append(acc)
    return out


def _moves_between(old: list[int], new: list[int]) -> list[Move]:
    moves = []
    for s, (p, q) in enumerate(zip(_bounds(old), _bounds(new), strict=True)):
        if q < p:
            moves.append(Move(tuple(range(q, p)), s, s + 1))
        elif q > p:
            moves.append(Move(tuple(range(p, q)), s + 1, s))
    return moves


def _valid(counts: list[int]) -> bool:
    return all(c >= 1 for c in counts)


def one_hop_moves(old: list[int], target: list[int]) -> tuple[list[Move], list[int]]:
    """Moves taking partition ``old`` toward ``target`` with each layer moving one stage.

    A layer can only move to a neighbouring stage in one step; a plan that needs longer
    trips is reached over several steps (call again with the returned partition).

    Args:
        old: layers per stage now.
        target: layers per stage wanted (same total, same number of stages).

    Returns:
        The moves of this step and the partition after them (``target`` when one hop is
        enough). No stage is ever left empty.
    """
    if len(old) != len(target) or sum(old) != sum(target) or not _valid(old) \
            or not _valid(target):
        raise PlanError(f"cannot move from partition {old} to {target}: both need the same "
                        f"number of stages and layers, and no empty stage")
    n, p_b, q_b = sum(old), _bounds(old), _bounds(target)
    clamped = []
    for s, q in enumerate(q_b):
        lo = (p_b[s - 1] if s > 0 else 0) + 1
        hi = (p_b[s + 1] if s + 1 < len(p_b) else n) - 1
        clamped.append(min(max(q, lo), hi))
    counts = [b - a for a, b in zip([0, *clamped], [*clamped, n], strict=True)]
    if not _valid(counts):  # move one boundary at a time instead
        s = next(i for i, (p, q) in enumerate(zip(p_b, q_b, strict=True)) if p != q)
        bounds = list(p_b)
        bounds[s] = clamped[s]
        counts = [b - a for a, b in zip([0, *bounds], [*bounds, n], strict=True)]
    return _moves_between(old, counts), counts


def _index(actions: list[Action], kind: ActionKind, mb: int) -> int:
    for i, a in enumerate(actions):
        if a.kind == kind and a.mb == mb:
            return i
    raise PlanError(f"stage {actions[0].stage} has no {kind}{mb} in its schedule")


def migration_schedule(schedules: list[list[Action]], moves: list[Move],
                       switch_mb: int) -> MigrationSchedule:
    """Insert the migration actions of ``moves`` into a step's action lists.

    Args:
        schedules: the step's actions per stage (e.g. from ``build_schedule``).
        moves: moves between neighbouring stages (from :func:`one_hop_moves`).
        switch_mb: ``k``; must leave a forward after it (``0 <= k < m - 1``).

    Returns:
        The new lists and, per move, the shipped and kept micro-batches.

    Raises:
        PlanError: bad ``switch_mb``, a move between non-neighbours, or a deadlock.
    """
    n_micro = sum(a.kind == ActionKind.F for a in schedules[0])
    if not 0 <= switch_mb < n_micro - 1:
        raise PlanError(f"switch micro-batch {switch_mb} must be in 0..{n_micro - 2} (a "
                        f"forward must follow it); use more micro-batches")
    new = [list(acts) for acts in schedules]
    # positions in the original lists decide shipping; insertion uses anchors
    shipped, kept = [], []
    for mv in moves:
        if abs(mv.giver - mv.receiver) != 1:
            raise PlanError(f"move {mv} is not between neighbouring stages")
        g, r = schedules[mv.giver], schedules[mv.receiver]
        g_pos = _index(g, ActionKind.F, switch_mb)  # MIG_SEND goes right after this
        r_pos = _index(r, ActionKind.F, switch_mb + 1)  # MIG_RECV goes right before this
        ship, keep = [], []
        for j in range(switch_mb + 1):
            g_done = _index(g, ActionKind.B, j) < g_pos
            r_done = _index(r, ActionKind.B, j) < r_pos
            if not g_done and not r_done:
                ship.append(j)
            elif not g_done:
                keep.append(j)
        shipped.append(ship)
        kept.append(keep)
    for i, mv in enumerate(moves):
        gl, rl = new[mv.giver], new[mv.receiver]
        gl.insert(0, Action(mv.giver, ActionKind.MIG_PREPARE, i))
        gl.insert(_index(gl, ActionKind.F, switch_mb) + 1,
                  Action(mv.giver, ActionKind.MIG_SEND, i))
        gl.insert(_index(gl, ActionKind.SYNC, -1), Action(mv.giver, ActionKind.MIG_FINISH, i))
        rl.insert(_prepares(rl), Action(mv.receiver, ActionKind.MIG_ACCEPT, i))
        rl.insert(_index(rl, ActionKind.F, switch_mb + 1),
                  Action(mv.receiver, ActionKind.MIG_RECV, i))
        rl.insert(_index(rl, ActionKind.SYNC, -1), Action(mv.receiver, ActionKind.MIG_ADOPT, i))
    plan = MigrationSchedule(new, list(moves), switch_mb, shipped, kept)
    check_schedule(new)
    return plan


def _prepares(actions: list[Action]) -> int:
    """Index after the leading MIG_PREPAREs/ACCEPTs (a stage's own sends go first)."""
    i = 0
    while i < len(actions) and actions[i].kind in (ActionKind.MIG_PREPARE, ActionKind.MIG_ACCEPT):
        i += 1
    return i
