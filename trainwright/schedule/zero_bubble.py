"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) as action lists.

A backward splits into ``B`` (the input gradient, which the previous stage waits for) and
``W`` (the weight gradient, which only the optimizer step needs). W passes then fill the
time a stage would otherwise wait.

The compute order of every stage comes from a list-scheduling dry run with unit costs
(``F = B = W = 1``, free communication): whenever a stage is free it takes, in order of
preference, a ``B`` whose gradient has arrived, an ``F`` whose input has arrived (while
fewer than its forward limit are in flight), else a pending ``W``; a stage that holds more
than its memory limit of micro-batches (forwarded, ``W`` not done) does a ``W`` first.
The order is then lowered to actions with explicit sends and receives, like 1F1B's.

* **ZB-H1**: stage ``i`` forwards like 1F1B (at most ``p - i`` micro-batches between ``F``
  and ``B``) and holds at most ``min(p, p - i + 1)`` micro-batches until their ``W``: the
  busiest stage (stage 0) holds ``p``, as in 1F1B. With ``F = B = W`` the step takes
  ``3m + (p - 1) + 1`` units for ``p`` in 2..6 (1F1B: ``3m + 3(p - 1)``; the paper's
  ZB-H1, which lets W-waiting micro-batches exceed ``p`` because W needs fewer bytes than
  B, ``3m + (p - 1)``); at ``p = 2`` it is the paper's.
* **ZB-H2**: up to ``2p - 1 - i`` forwards in flight, so the warm-up bubble fills with
  forwards as well: less bubble, more memory (about twice 1F1B's on stage 0).
"""

from __future__ import annotations

from trainwright.schedule.base import Action, ActionKind, _check, _with_comm

__all__ = ["zb_h1", "zb_h2", "zb_order"]


def zb_order(n_stages: int, n_micro: int, f_limit: list[int],
             w_limit: list[int]) -> list[list[tuple[ActionKind, int]]]:
    """Each stage's compute order ``[(kind, mb), ...]`` from the unit-cost dry run.

    Args:
        n_stages, n_micro: ``p`` and ``m``.
        f_limit: per stage, micro-batches at most between ``F`` and ``B``.
        w_limit: per stage, micro-batches at most between ``F`` and ``W``.
    """
    p, m = n_stages, n_micro
    done: dict[tuple[int, ActionKind, int], int] = {}  # (stage, kind, mb) -> end time
    order: list[list[tuple[ActionKind, int]]] = [[] for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    t = 0
    while any(nw[s] < m for s in range(p)):
        for s in range(p):
            pick = _pick(s, p, m, t, done, nf[s], nb[s], nw[s], f_limit[s], w_limit[s])
            if pick is None:
                continue
            kind = pick
            counter = {ActionKind.F: nf, ActionKind.B: nb, ActionKind.W: nw}[kind]
            mb = counter[s]
            counter[s] += 1
            done[(s, kind, mb)] = t + 1
            order[s].append((kind, mb))
        t += 1
        if t > 10 * p * m + 10:  # pragma: no cover - the limits are >= 1: always progress
            raise RuntimeError("zero-bubble dry run made no progress")
    return order


def _pick(s: int, p: int, m: int, t: int, done: dict, nf: int, nb: int, nw: int,
          f_limit: int, w_limit: int) -> ActionKind | None:
    """What stage ``s`` starts at time ``t`` (None: it waits)."""
    def ready(key) -> bool:
        return key in done and done[key] <= t

    busy_until = max((v for (st, _, _), v in done.items() if st == s), default=0)
    if busy_until > t:
        return None
    can_b = nb < nf and ready((s + 1, ActionKind.B, nb) if s < p - 1 else (s, ActionKind.F, nb))
    can_f = (nf < m and nf - nb < f_limit and nf - nw < w_limit
             and (s == 0 or ready((s - 1, ActionKind.F, nf))))
    if can_b:
        return ActionKind.B
    if nw < nb and nf - nw >= w_limit:
        return ActionKind.W
    if can_f:
        return ActionKind.F
    if nw < nb:
        return ActionKind.W
    return None


def _lower(order: list[list[tuple[ActionKind, int]]], n_stages: int) -> list[list[Action]]:
    return [_with_comm(s, n_stages, compute) for s, compute in enumerate(order)]


def zb_h1(n_stages: int, n_micro: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's forwards in flight, ``W`` deferred into the cool-down's waits.

    Returns:
        One action list per stage (``F``, ``B`` = input gradients, ``W`` = weight gradients).
    """
    _check(n_stages, n_micro)
    p = n_stages
    f_limit = [p - s for s in range(p)]
    w_limit = [min(p, p - s + 1) for s in range(p)]
    return _lower(zb_order(p, n_micro, f_limit, w_limit), p)


def zb_h2(n_stages: int, n_micro: int) -> list[list[Action]]:
    """ZB-H2: up to ``2p - 1 - i`` forwards in flight on stage ``i`` (less bubble, more memory).

    Returns:
        One action list per stage.
    """
    _check(n_stages, n_micro)
    p = n_stages
    f_limit = [2 * p - 1 - s for s in range(p)]
    w_limit = [2 * p - 1 - s for s in range(p)]
    return _lower(zb_order(p, n_micro, f_limit, w_limit), p)
