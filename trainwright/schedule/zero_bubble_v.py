"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024) as action lists.

Two model chunks per rank in a V: the model is cut into ``2p`` stages and rank ``r`` holds
stages ``r`` and ``2p - 1 - r``, so a micro-batch's forward goes down the ranks and back
up, and rank 0 holds both the first stage and the loss. Stages ``p - 1`` and ``p`` share
rank ``p - 1``: their hand-over stays on the rank (the executor passes it locally).
The backward is split into ``B`` and ``W`` as in ZB-H1/H2 (:mod:`.zero_bubble`).

Each rank's order comes from a list-scheduling dry run (``F = B = W``, a hand-over to
another rank costing half an action, see ``LATENCY``): a free rank takes, in order of
preference, a ready ``B`` (oldest micro-batch, later stage first), a ready forward of its
second chunk, a ready forward of its first chunk while it holds fewer than ``2p`` chunk
micro-batches (forwarded, ``W`` not done: about 1F1B's activation memory, in halves),
else its oldest pending ``W``.
"""

from __future__ import annotations

from trainwright.errors import PlanError
from trainwright.schedule.base import Action

__all__ = ["zb_v", "v_rank_of"]


COST, LATENCY = 2, 1
"""Dry-run ticks per action and per hand-over to another rank. Under unit costs and free
communication the steady state's dependency loop (a micro-batch's ``B`` down the V and the
next ``F`` back) exactly fills a rank's cycle, so any real latency, or a ``B`` dearer than a
``W``, stalls both ranks every micro-batch: measured on the pipeline bench (2 ranks, 8
micro-batches) step / compute bound 1.08-1.09. Pricing a hand-over at half an action
makes the dry run keep slack in that loop: 1.04-1.06 on the same work."""


def v_rank_of(stage: int, n_ranks: int) -> int:
    """The rank holding virtual stage ``stage`` in the V placement."""
    return stage if stage < n_ranks else 2 * n_ranks - 1 - stage


def _order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Every rank's compute order ``(kind, stage, mb)`` from the unit-cost dry run."""
    n = 2 * p
    done: dict[tuple[str, int, int], int] = {}  # -> end time
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    nxt = {(k, s): 0 for k in "FBW" for s in range(n)}  # next micro-batch per kind, stage
    t, total = 0, 3 * n * m
    while len(done) < total:
        for r in range(p):
            pick = _pick(r, p, m, t, done, nxt)
            if pick is not None:
                kind, s = pick
                mb = nxt[(kind, s)]
                nxt[(kind, s)] += 1
                done[(kind, s, mb)] = t + COST
                order[r].append((kind, s, mb))
        t += 1
        if t > 10 * COST * total + 10:  # pragma: no cover - the rules always leave a move
            raise PlanError("ZB-V dry run made no progress")
    return order


def _pick(r: int, p: int, m: int, t: int, done: dict, nxt: dict) -> tuple[str, int] | None:
    """What rank ``r`` starts at time ``t`` (None: it waits)."""
    n = 2 * p
    first, second = r, n - 1 - r

    def ready(key) -> bool:  # a hand-over from another rank arrives LATENCY later
        lag = 0 if v_rank_of(key[1], p) == r else LATENCY
        return key in done and done[key] + lag <= t

    if any(end > t for (_, s, _), end in done.items() if v_rank_of(s, p) == r):
        return None  # busy
    bs = []
    for s in (second, first):
        mb = nxt[("B", s)]
        if mb < nxt[("F", s)] and ready(("B", s + 1, mb) if s < n - 1 else ("F", s, mb)):
            bs.append((mb, -s, s))
    if bs:
        return "B", min(bs)[2]
    held = sum(nxt[("F", s)] - nxt[("W", s)] for s in (first, second))
    for s in (second, first):
        mb = nxt[("F", s)]
        if mb < m and (s == 0 or ready(("F", s - 1, mb))) and (s == second or held < n):
            return "F", s
    ws = [(done[("B", s, nxt[("W", s)])], s) for s in (first, second)
          if nxt[("W", s)] < nxt[("B", s)]]
    return ("W", min(ws)[1]) if ws else None


def _lower(rank: int, n_stages: int, order: list[tuple[str, int, int]]) -> list[Action]:
    out: list[Action] = []
    for kind, s, mb in order:
        if kind == "F":
            out += ([Action(s, "RECV_F", mb)] if s > 0 else []) + [Action(s, "F", mb)]
            out += [Action(s, "SEND_F", mb)] if s < n_stages - 1 else []
        elif kind == "B":
            out += ([Action(s, "RECV_B", mb)] if s < n_stages - 1 else []) + [Action(s, "B", mb)]
            out += [Action(s, "SEND_B", mb)] if s > 0 else []
        else:
            out.append(Action(s, "W", mb))
    return out + [Action(rank, "SYNC"), Action(rank, "STEP")]


def zb_v(n_ranks: int, n_micro: int, virtual_stages: int = 2) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V, split backward; one action list per **rank**.

    Args:
        n_ranks: pipeline ranks ``p`` (the model has ``2p`` stages).
        n_micro: micro-batches per step.
        virtual_stages: must be 2 (the V has two legs).
    """
    if n_ranks < 1 or n_micro < 1:
        raise PlanError(f"need at least 1 stage and 1 micro-batch, got {n_ranks} and {n_micro}")
    if virtual_stages != 2:
        raise PlanError(f"ZB-V places exactly 2 chunks per rank (parallel.virtual_stages = 2),"
                        f" got {virtual_stages}")
    order = _order(n_ranks, n_micro)
    return [_lower(r, 2 * n_ranks, order[r]) for r in range(n_ranks)]
