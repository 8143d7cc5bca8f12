"""Interleaved 1F1B (Narayanan et al., 2021; torch's ``ScheduleInterleaved1F1B``) as data.

The model is cut into ``p * v`` *virtual stages*; rank ``r`` of ``p`` holds the ``v``
chunks ``r, r + p, ..., r + (v - 1) p`` (round-robin). A micro-batch's forward visits the
ranks ``v`` times, so each rank's warm-up bubble is shared by ``v`` chunks and the bubble
shrinks about ``v``-fold, at the cost of ``v`` times the messages.

Each rank's order (Megatron / torch): micro-batches go in rounds of ``p``; forward op
``k`` runs chunk ``(k // p) % v`` of the rank; rank ``r`` first runs
``(v - 1) p + 2 (p - 1 - r)`` forwards (capped at ``m v``), then alternates one forward and
one backward, then drains backwards; backward op ``k`` (counted from the end of the
warm-up) runs the chunks in reverse, ``v - 1 - (k // p) % v``. Micro-batches of one chunk
go in order. Requires ``m`` to be a multiple of ``p`` (torch relaxes that to rounds; here a
config error says so).

Unlike the other schedules, the lists are **one per rank**, and every action names its
virtual stage (``Action.stage``). Sends and receives go between virtual stages ``s`` and
``s + 1``, that is between ranks ``s % p`` and ``(s + 1) % p``.
"""

from __future__ import annotations

from trainwright.errors import PlanError
from trainwright.schedule.base import Action, ActionKind, _lower

__all__ = ["interleaved_1f1b", "check_interleaved", "rank_of_stage"]


def check_interleaved(n_ranks: int, n_micro: int, virtual_stages: int) -> None:
    """Raise PlanError unless ``v >= 2`` and ``m`` is a positive multiple of ``p``."""
    if n_ranks < 1 or n_micro < 1:
        raise PlanError(f"need at least 1 stage and 1 micro-batch, got {n_ranks} and {n_micro}")
    if virtual_stages < 2:
        raise PlanError(f"interleaved 1F1B needs parallel.virtual_stages >= 2, got "
                        f"{virtual_stages}")
    if n_micro % n_ranks:
        raise PlanError(f"interleaved 1F1B needs train.micro_batches to be a multiple of "
                        f"parallel.pp = {n_ranks}, got {n_micro}")


def rank_of_stage(stage: int, n_ranks: int) -> int:
    """The rank holding virtual stage ``stage`` (round-robin)."""
    return stage % n_ranks


def _compute_order(rank: int, p: int, m: int, v: int) -> list[tuple[ActionKind, int, int]]:
    """Rank ``rank``'s compute order as ``(kind, virtual stage, mb)``."""
    total = m * v
    warm = min((v - 1) * p + 2 * (p - 1 - rank), total)
    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}
    order = []

    def take(kind: ActionKind, stage: int, counter: dict[int, int]) -> None:
        mb = counter.get(stage, 0)
        counter[stage] = mb + 1
        order.append((kind, stage, mb))

    for k in range(total):
        take(ActionKind.F, ((k // p) % v) * p + rank, fwd_mb)
        if k >= warm:
            j = k - warm
            take(ActionKind.B, (v - 1 - (j // p) % v) * p + rank, bwd_mb)
    for j in range(total - warm, total):
        take(ActionKind.B, (v - 1 - (j // p) % v) * p + rank, bwd_mb)
    return order


def interleaved_1f1b(n_ranks: int, n_micro: int, virtual_stages: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B: ``v`` chunks per rank, one action list per **rank**.

    Args:
        n_ranks: pipeline ranks ``p`` (the model has ``p * v`` virtual stages).
        n_micro: micro-batches per step ``m`` (a multiple of ``p``).
        virtual_stages: chunks per rank ``v`` (at least 2).

    Returns:
        One action list per rank; ``Action.stage`` is the virtual stage.
    """
    check_interleaved(n_ranks, n_micro, virtual_stages)
    n_stages = n_ranks * virtual_stages
    return [_lower(_compute_order(r, n_ranks, n_micro, virtual_stages), n_stages, r)
            for r in range(n_ranks)]
