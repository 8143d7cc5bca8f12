"""Pipeline schedules as data: one list of actions per stage.

An action is ``Action(stage, kind, mb)``, its kind an
:class:`~trainwright.schedule.base.ActionKind`, and prints like torch pipelining's
notation, ``"1F0"`` = stage 1, forward, micro-batch 0. Communication is explicit
(``RECV_F``/``SEND_F`` carry activations forward, ``RECV_B``/``SEND_B`` gradients back) so
that the executor and a simulator replay exactly the same lists. A step ends with one
``SYNC`` (data-parallel gradient reduction) and one ``STEP`` (optimizer) per stage.

GPipe, 4 stages, 4 micro-batches (compute only)::

    stage 0: F0 F1 F2 F3 .  .  .  B3 B2 B1 B0
    stage 3: .  .  .  F0 F1 F2 F3 B3 B2 B1 B0   (last stage turns each F straight into B)

1F1B keeps at most ``p - i`` micro-batches in flight on stage ``i``: ``p - i - 1`` warm-up
forwards, then alternate one forward and one backward, then drain the backwards.
"""

from __future__ import annotations

from trainwright.errors import PlanError

__all__ = ["Action", "ActionKind", "KINDS", "COMPUTE", "gpipe", "one_f_one_b", "build_schedule",
           "format_grid", "SCHEDULES", "SPLIT_BACKWARD", "VIRTUAL_SCHEDULES", "stage_ranks",
           "max_in_flight", "max_waiting_w"]

from trainwright.schedule.base import COMPUTE, KINDS, Action, ActionKind, _check, _with_comm
from trainwright.schedule.interleaved import interleaved_1f1b
from trainwright.schedule.zero_bubble import zb_h1, zb_h2
from trainwright.schedule.zero_bubble_v import v_rank_of, zb_v


def gpipe(n_stages: int, n_micro: int) -> list[list[Action]]:
    """All forwards, then all backwards (in reverse micro-batch order).

    Args:
        n_stages: pipeline stages ``p``.
        n_micro: micro-batches per step ``m``.

    Returns:
        One action list per stage.
    """
    _check(n_stages, n_micro)
    compute = [(ActionKind.F, m) for m in range(n_micro)]
    compute += [(ActionKind.B, m) for m in reversed(range(n_micro))]
    return [_with_comm(s, n_stages, compute) for s in range(n_stages)]


def one_f_one_b(n_stages: int, n_micro: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: warm-up forwards, one-forward-one-backward, drain.

    Args:
        n_stages: pipeline stages ``p``.
        n_micro: micro-batches per step ``m``.

    Returns:
        One action list per stage; stage ``i`` holds at most ``min(p - i, m)`` micro-batches.
    """
    _check(n_stages, n_micro)
    schedules = []
    for s in range(n_stages):
        warm = min(n_stages - s - 1, n_micro)
        compute = [(ActionKind.F, m) for m in range(warm)]
        fwd, bwd = warm, 0
        while bwd < n_micro:
            if fwd < n_micro:
                compute.append((ActionKind.F, fwd))
                fwd += 1
            compute.append((ActionKind.B, bwd))
            bwd += 1
        schedules.append(_with_comm(s, n_stages, compute))
    return schedules


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}
"""Schedule name -> generator ``(n_stages, n_micro) -> one action list per stage``."""

SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v")
"""Schedules whose backward is split into ``B`` (input gradients) and ``W`` (weights)."""

VIRTUAL_SCHEDULES = {"interleaved-1f1b": interleaved_1f1b, "zb-v": zb_v}
"""Schedules with several model chunks per rank: name -> generator
``(n_ranks, n_micro, virtual_stages) -> one action list per rank``."""


def stage_ranks(name: str, n_ranks: int, virtual_stages: int = 1) -> list[int]:
    """Pipeline rank of every model stage: round-robin (``s mod p``; one stage per rank:
    the identity), or the V of ZB-V (rank ``r`` holds ``r`` and ``2p - 1 - r``)."""
    n = n_ranks * virtual_stages
    if name == "zb-v":
        return [v_rank_of(s, n_ranks) for s in range(n)]
    return [s % n_ranks for s in range(n)]


def build_schedule(name: str, n_stages: int, n_micro: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """Look up a schedule by name (one of :data:`SCHEDULES` or :data:`VIRTUAL_SCHEDULES`)
    and generate it: one action list per stage, or, for an interleaved schedule, one per
    rank (``n_stages`` ranks of ``virtual_stages`` chunks each)."""
    if name in VIRTUAL_SCHEDULES:
        return VIRTUAL_SCHEDULES[name](n_stages, n_micro, virtual_stages)
    if virtual_stages != 1:
        raise PlanError(f"schedule {name!r} runs one stage per rank; virtual_stages = "
                        f"{virtual_stages} needs one of {sorted(VIRTUAL_SCHEDULES)}")
    try:
        return SCHEDULES[name](n_stages, n_micro)
    except KeyError:
        names = sorted([*SCHEDULES, *VIRTUAL_SCHEDULES])
        raise PlanError(f"unknown schedule {name!r}; choose one of {names}") from None


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches forwarded but not yet back-propagated at once (with a
    split backward: whose ``W`` is not done, since their activations are held until then)."""
    split = any(a.kind == ActionKind.W for a in actions)
    release = ActionKind.W if split else ActionKind.B
    live, peak = 0, 0
    for a in actions:
        live += (a.kind == ActionKind.F) - (a.kind == release)
        peak = max(peak, live)
    return peak


def max_waiting_w(actions: list[Action]) -> int:
    """Most micro-batches at once whose ``B`` has started and whose ``W`` is not done (0 for
    schedules without ``W``)."""
    split = any(a.kind == ActionKind.W for a in actions)
    live, peak = 0, 0
    for a in actions:
        if a.kind == ActionKind.B and split:
            live += 1
            peak = max(peak, live)
        elif a.kind == ActionKind.W:
            live -= 1
    return peak


def format_grid(schedule: list[list[Action]]) -> str:
    """Render compute actions as a step x stage grid (rows are clock ticks).

    The tick of an action is found by a dry run: a forward waits for the previous stage's
    forward of the same micro-batch, a backward for the next stage's backward, and every
    action waits for the one before it on its stage. A deadlocked schedule raises. With
    one list per rank (interleaved), columns are ranks and cells name the virtual stage
    (``1F0``: stage 1, forward, micro-batch 0).
    """
    n = len(schedule)
    compute = [[a for a in acts if a.kind in COMPUTE] for acts in schedule]
    n_virtual = 1 + max((a.stage for acts in compute for a in acts), default=0)
    per_rank = n_virtual != n
    done: dict[tuple[int, ActionKind, int], int] = {}
    cells: dict[tuple[int, int], str] = {}
    pos = [0] * n
    free = [0] * n
    while any(pos[s] < len(compute[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            if pos[s] >= len(compute[s]):
                continue
            a = compute[s][pos[s]]
            dep = _grid_dependency(a, n_virtual)
            if 0 <= dep[0] < n_virtual and dep not in done:
                continue
            tick = max(free[s], done.get(dep, -1) + 1)
            done[(a.stage, a.kind, a.mb)] = tick
            cells[(tick, s)] = str(a) if per_rank else f"{a.kind}{a.mb}"
            free[s] = tick + 1
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: str(compute[s][pos[s]]) for s in range(n) if pos[s] < len(compute[s])}
            raise PlanError(f"schedule deadlocks; stages wait on {stuck}")
    ticks = max(done.values()) + 1
    grid = [[cells.get((t, s), ".") for s in range(n)] for t in range(ticks)]
    width = max(4, *(len(c) for row in grid for c in row)) + 1
    label = "r" if per_rank else "s"
    head = "step " + "".join(f"{label}{s}".ljust(width) for s in range(n))
    rows = [f"{t:<5}" + "".join(c.ljust(width) for c in row) for t, row in enumerate(grid)]
    return "\n".join([head, *rows])


def _grid_dependency(a: Action, n_stages: int) -> tuple[int, ActionKind, int]:
    """The compute action ``a`` waits for (a stage index out of range: none)."""
    s = a.stage
    if a.kind == ActionKind.W:
        return (s, ActionKind.B, a.mb)
    if a.kind == ActionKind.F:
        return (s - 1, ActionKind.F, a.mb)
    if s == n_stages - 1:
        return (s, ActionKind.F, a.mb)
    return (s + 1, ActionKind.B, a.mb)
